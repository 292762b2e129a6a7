#!/usr/bin/env bash
# On a GPU machine (root, from the repository root; no network, no apt needed): installs SLURM 22.05
# and munge from the kit that tools/gpu/slurm-kit.sh built (tests/slurm_cluster/kit_install.py: the
# image's own libraries are never replaced) and boots a real cluster with
# tests/slurm_cluster/boot.sh, the CPU suite's boot script: munged, slurmctld and one slurmd per
# virtual node on 127.0.0.1, each node's GPUs the machine's real /dev/nvidiaN (gres.conf File=,
# AutoDetect=off), split in order: 4 GPUs and 2 nodes give n1 GPUs 0,1 and n2 GPUs 2,3. SLURM would
# give n2's jobs CUDA_VISIBLE_DEVICES=0,1 (it numbers each node's GPUs from 0); boot.sh's
# TaskProlog makes that the machine's 2,3 (RLSLURM_CI_GPU_REMAP=0 shows SLURM's own numbers).
# docs/slurm-test-cluster.md ("SLURM on the GPU machine") has the facts, CUDA_VISIBLE_DEVICES included.
#
# Usage: bash tools/gpu/slurm-boot.sh [KIT_DIR]        (default .gpu-bundle/slurm)
#        bash tests/slurm_cluster/stop.sh              (stops it; same RLSLURM_CI_RUN if you set one)
# Env:   RLSLURM_GPU_NODES  virtual nodes (default 2; 1 = node n1 with every GPU, for --nodes 1 jobs)
#        RLSLURM_GPU_COUNT  GPUs to use (default: every /dev/nvidiaN), split evenly over the nodes
#        RLSLURM_GPU_DEV    device path prefix (default /dev/nvidia; tests point it at fake devices)
#        RLSLURM_CI_*       any knob of tests/slurm_cluster/boot.sh (ports, state/log/pid dirs, ...);
#                           RLSLURM_CI_CPUS / RLSLURM_CI_MEM_MB default to the whole machine per node.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
KIT="${1:-.gpu-bundle/slurm}"
NODES="${RLSLURM_GPU_NODES:-2}"
DEV="${RLSLURM_GPU_DEV:-/dev/nvidia}"
die() { printf '[slurm-boot] ERROR: %s\n' "$*" >&2; exit 1; }

[ -s "$KIT/manifest.tsv" ] || die "no kit at $KIT (build it where apt works: bash tools/gpu/slurm-kit.sh)"
KIT="$(cd "$KIT" && pwd)"
[[ "$NODES" =~ ^[1-9][0-9]*$ ]] || die "RLSLURM_GPU_NODES='$NODES' must be a positive integer"

# The GPUs (nvidia0, nvidia1, ...; not nvidiactl, nvidia-uvm, ...) in CUDA's PCI order, which is
# nvidia-smi's index: `nvidia-smi -q` lists the GPUs by index, each with the minor number M of its
# /dev/nvidiaM. Usually M is the index; where nvidia-smi is absent (tests) it is taken to be.
mapfile -t files < <(for f in "$DEV"[0-9]*; do [[ "$f" =~ ^"$DEV"[0-9]+$ ]] && [ -c "$f" ] && echo "$f"; done | sort -V)
[ "${#files[@]}" -gt 0 ] || die "no GPU devices ${DEV}N (character devices) on this machine"
declare -A index_of=()
if command -v nvidia-smi >/dev/null; then
  i=0
  while read -r minor; do
    [[ "$minor" =~ ^[0-9]+$ ]] && index_of[$minor]=$i
    i=$((i + 1))
  done < <(nvidia-smi -q 2>/dev/null | awk -F: '/^ *Minor Number/ { gsub(/ /, "", $2); print $2 }')
fi
mapfile -t pairs < <(for f in "${files[@]}"; do m="${f#"$DEV"}"; echo "${index_of[$m]:-$m} $f"; done | sort -n)
devs=() cuda=()
for p in "${pairs[@]}"; do cuda+=("${p%% *}"); devs+=("${p#* }"); done
[ "$(printf '%s\n' "${cuda[@]}" | sort -u | wc -l)" = "${#cuda[@]}" ] || die "two GPU devices map to one CUDA number: ${cuda[*]}"
COUNT="${RLSLURM_GPU_COUNT:-${#devs[@]}}"
[[ "$COUNT" =~ ^[1-9][0-9]*$ ]] && [ "$COUNT" -le "${#devs[@]}" ] || die "RLSLURM_GPU_COUNT=$COUNT: there are ${#devs[@]} GPU devices"
[ $((COUNT % NODES)) = 0 ] || die "$COUNT GPUs do not split evenly over $NODES nodes (RLSLURM_GPU_NODES / RLSLURM_GPU_COUNT)"
per=$((COUNT / NODES))
groups="" ids=""
for ((n = 0; n < NODES; n++)); do
  groups+="${groups:+ }$(IFS=,; echo "${devs[*]:n*per:per}")"
  ids+="${ids:+ }$(IFS=,; echo "${cuda[*]:n*per:per}")"
done

mem_mb=$(( $(awk '/^MemTotal:/{print $2}' /proc/meminfo) / 1024 ))
export RLSLURM_CI_KIT="$KIT"
export RLSLURM_CI_NODES="$NODES"
export RLSLURM_CI_GPU_FILES="$groups"
export RLSLURM_CI_GPU_IDS="$ids"
# Whatever cgroups the image has (none, v2 read-only in a container): slurmd starts (boot.sh says why).
export RLSLURM_CI_CGROUP_PLUGIN="${RLSLURM_CI_CGROUP_PLUGIN:-cgroup/v1}"
export RLSLURM_CI_CPUS="${RLSLURM_CI_CPUS:-$(nproc)}"
export RLSLURM_CI_MEM_MB="${RLSLURM_CI_MEM_MB:-$mem_mb}"
printf '[slurm-boot] %s node(s); device files per node: %s; their CUDA numbers: %s\n' "$NODES" "$groups" "$ids"
bash "$repo/tests/slurm_cluster/boot.sh"

export PATH="$PATH:/usr/sbin:/sbin"
export SLURM_CONF="${RLSLURM_CI_CONF_DIR:-/etc/slurm}/slurm.conf"
echo "---- sinfo"
sinfo -N -h -o '%N %T %c %G' | sort -u
echo "---- scontrol show node (gres)"
scontrol show node | grep -E '^NodeName|Gres=|CfgTRES=' | sed 's/^ */  /'
echo "---- gres.conf"
grep -v '^#' "$(dirname "$SLURM_CONF")/gres.conf"
if [ "${RLSLURM_CI_CONF_DIR:-/etc/slurm}" != /etc/slurm ]; then
  echo "clients: export SLURM_CONF=$SLURM_CONF"
fi
