#!/usr/bin/env bash
# The README's demo. Installs what it needs, then runs GRPO on the toy task:
#   bash tools/demo.sh           local mode (`rlslurm run --demo`): trainer + rollout group on this machine
#   bash tools/demo.sh --slurm   the same as a heterogeneous job on a local SLURM test cluster
# Extra arguments after the mode are passed to rlslurm (e.g. --num-rollout 60).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=local
if [ "${1:-}" = "--slurm" ]; then mode=slurm; shift; fi
bash tools/install.sh

if [ "$mode" = local ]; then
  exec rlslurm run --demo --run-dir "${DEMO_RUN_DIR:-runs/demo}" --num-rollout 40 "$@"
fi

export RLSLURM_CI_NODES="${RLSLURM_CI_NODES:-4}" RLSLURM_CI_GPUS="${RLSLURM_CI_GPUS:-8}"
bash tests/slurm_cluster/boot.sh
[ "${DEMO_KEEP_CLUSTER:-0}" = 1 ] || trap 'bash tests/slurm_cluster/stop.sh' EXIT
work="$(mktemp -d /tmp/rlslurm-demo.XXXXXX)"
python3 -c 'import sys; from rlslurm.demo_task import make_prompts; make_prompts(sys.argv[1])' "$work/prompts.jsonl"
rlslurm submit --model tiny-qwen3 --nodes 2 --prompt-data "$work/prompts.jsonl" --run-dir "$work/run" \
  --run-name demo --gpus-per-node 2 --no-exclusive --cpus-per-node 2 --time 30 --num-rollout 40 --num-epoch 100 \
  --custom-rm-path rlslurm.demo_task:reward --rollout-dtype float32 "$@"
state=PENDING
for _ in $(seq 1 1800); do
  state=$(rlslurm status "$work/run" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["slurm"]["state"])')
  case "$state" in COMPLETED|FAILED|CANCELLED|TIMEOUT) break ;; esac
  sleep 1
done
rlslurm status "$work/run"
python3 -c 'import sys; from rlslurm.curve import reward_curve, sparkline; p = reward_curve(sys.argv[1]); print("reward:", sparkline([v for _, v in p], 0, 1))' "$work/run"
[ "$state" = COMPLETED ]
echo "demo run directory: $work/run"
