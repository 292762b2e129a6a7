#!/usr/bin/env bash
# After tools/gpu/slurm-boot.sh: which physical GPUs SLURM's jobs really get. With 2+ nodes it runs a
# het job of one node per component (--gpus-per-node=G each, --exclusive, as `rlslurm submit`
# renders it); with 1 node two jobs of half the node's GPUs each, side by side. Every step prints its
# node, CUDA_VISIBLE_DEVICES and the UUIDs of the devices CUDA (torch) gives it, mapped to
# nvidia-smi's index. Fails if two nodes or two jobs got the same physical GPU.
# Usage: bash tools/gpu/slurm-check.sh [WORKDIR]      (default /tmp/slurm-check; needs torch)
set -euo pipefail
export PATH="$PATH:/usr/sbin:/sbin"
work="${1:-/tmp/slurm-check}"
rm -rf "$work"; mkdir -p "$work"
nodes=$(sinfo -h -N -o '%N' | sort -u | wc -l)
gpus=$(sinfo -h -N -o '%G' | sort -u | head -n1 | sed -n 's/^gpu:\([0-9]*\).*/\1/p')
[ -n "$gpus" ] || { echo "no gpu gres on the nodes (sinfo: $(sinfo -h -N -o '%N %G' | sort -u | tr '\n' ' '))" >&2; exit 1; }
nvidia-smi --query-gpu=index,uuid --format=csv,noheader | tr -d ' ' >"$work/smi.csv"

cat >"$work/probe.py" <<'PY'
import os, sys
import torch
smi = dict(reversed(l.strip().split(",")) for l in open(sys.argv[1]) if l.strip())
uuids = ["GPU-" + str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
print(f"{sys.argv[2]} node={os.environ.get('SLURMD_NODENAME')} CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')} "
      f"CUDA_DEVICE_ORDER={os.environ.get('CUDA_DEVICE_ORDER')} SLURM_JOB_GPUS={os.environ.get('SLURM_JOB_GPUS')} "
      f"torch_sees_nvidia_smi_index={','.join(smi.get(u, '?' + u) for u in uuids)}", flush=True)
PY
probe="python3 $work/probe.py $work/smi.csv"
if [ "$nodes" -ge 2 ]; then
  per=$gpus
  cat >"$work/job.sh" <<EOF
#!/bin/bash
#SBATCH --output=$work/job-%j.out
#SBATCH --nodes=1 --ntasks-per-node=1 --gpus-per-node=$per --exclusive
#SBATCH hetjob
#SBATCH --nodes=1 --ntasks-per-node=1 --gpus-per-node=$per --exclusive
$probe batch
srun --het-group=0,1 $probe step
EOF
  jobs=$(sbatch --parsable "$work/job.sh")
else
  per=$((gpus / 2))
  cat >"$work/job.sh" <<EOF
#!/bin/bash
#SBATCH --output=$work/job-%j.out
#SBATCH --nodes=1 --ntasks-per-node=1 --gpus-per-node=$per
$probe batch
srun $probe step
sleep 5
EOF
  jobs="$(sbatch --parsable "$work/job.sh") $(sbatch --parsable "$work/job.sh")"
fi
for _ in $(seq 240); do [ -z "$(squeue -h -o %i)" ] && break; sleep 0.5; done
squeue -h | grep . && { echo "jobs still queued" >&2; exit 1; }
cat "$work"/job-*.out
# The GPUs each (node, job) used, by nvidia-smi index; no two may share one.
grep -h '^step' "$work"/job-*.out | sed 's/.*torch_sees_nvidia_smi_index=//' >"$work/used"
[ "$(wc -l <"$work/used")" -ge 2 ] || { echo "FAIL: expected 2 steps, got $(wc -l <"$work/used")"; exit 1; }
if grep -q '^$' "$work/used"; then echo "FAIL: a step saw no CUDA device"; exit 1; fi
tr ',' '\n' <"$work/used" | sort | uniq -d >"$work/dups"
if [ -s "$work/dups" ]; then echo "FAIL: GPUs used by two nodes or jobs: $(tr '\n' ' ' <"$work/dups")"; exit 1; fi
echo "OK: every node/job used GPUs of its own (jobs: $jobs)"
