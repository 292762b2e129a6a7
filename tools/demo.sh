#!/usr/bin/env bash
# The README's demo: install, boot the local SLURM test cluster (several slurmd on this host),
# submit a tiny-model run with `rlslurm submit`, follow it with `rlslurm status` until it ends,
# then stop the cluster. Set DEMO_KEEP_CLUSTER=1 to leave the cluster up afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install.sh
export RLSLURM_CI_NODES="${RLSLURM_CI_NODES:-4}" RLSLURM_CI_GPUS="${RLSLURM_CI_GPUS:-8}"
bash tests/slurm_cluster/boot.sh
[ "${DEMO_KEEP_CLUSTER:-0}" = 1 ] || trap 'bash tests/slurm_cluster/stop.sh' EXIT

work="$(mktemp -d /tmp/rlslurm-demo.XXXXXX)"
python3 - "$work/prompts.jsonl" <<'PY'
import json, sys
with open(sys.argv[1], "w") as f:
    for c in "abcdefghijklmnop":
        f.write(json.dumps({"prompt": f"say {c}", "label": c}) + "\n")
PY
rlslurm submit --model tiny-qwen3 --nodes 2 --prompt-data "$work/prompts.jsonl" --run-dir "$work/run" \
  --run-name demo --gpus-per-node 2 --no-exclusive --cpus-per-node 2 --time 10 --num-rollout 0
for _ in $(seq 1 120); do
  state=$(rlslurm status "$work/run" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["slurm"]["state"])')
  case "$state" in COMPLETED|FAILED|CANCELLED|TIMEOUT) break ;; esac
  sleep 1
done
rlslurm status "$work/run"
[ "$state" = COMPLETED ]
echo "demo run directory: $work/run"
