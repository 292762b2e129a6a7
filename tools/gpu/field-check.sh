#!/usr/bin/env bash
# The field check, on a GPU machine (one GPU is enough): what a user does, not what the test suite does.
#   - rlslurm from a plain wheel install (a fresh venv, not this checkout), run from another directory
#     with relative paths;
#   - the trainer on the GPU (NCCL) replaying a CPU run's buffer (--load-debug-rollout-data);
#   - three runs side by side on the GPU: straight; stopped by SIGTERM to `rlslurm run` (a closed
#     terminal, `kill`) then run again; SIGTERM to the trainer's whole process tree (what slurmstepd
#     does on scancel/preemption) then run again. Runs straight and a save only at the end, b every 4
#     rollouts (so the TERM's save is not the trainer's first); a step trained twice means the signal's
#     checkpoint failed.
# Inputs (built here by tools/gpu/field-inputs.sh, carried as .field/): rlslurm-*.whl, deps/ (the CLI's
# dependencies the image lacks: typer and its own), replay.tgz.
# Needs the bundle's part 2 staged first (tools/gpu/stage.sh .gpu-bundle/p2: megatron-core, pydantic, ...).
# FIELD_DEVICE=cpu rehearses the script on a CPU machine (same flow, gloo instead of NCCL).
# Writes $OUT/field.json (tools/gpu/field_compare.py) and $OUT/field-runs.tgz (the runs' logs).
set -uo pipefail
here=$(pwd)
field="$here/.field"
prefix="${RLSLURM_GPU_PREFIX:-/tmp/rlslurm-gpu}"
work=/tmp/rlslurm-field
out="${OUT:-$work/out}"
rm -rf "$work"
mkdir -p "$work/user" "$out"
log() { printf '[field %s] %s\n' "$(date +%H:%M:%S)" "$*" | tee -a "$out/field.log"; }

. "$here/tools/gpu/field-install.sh"
log "image packages: numpy from $(python3 -c 'import numpy; print(numpy.__file__)' 2>&1 | tail -n 1)"
cd "$work/user"
tar -xzf "$field/replay.tgz"
log "rlslurm imported from $(python3 -c 'import rlslurm; print(rlslurm.__file__)')"
rlslurm --help > /dev/null 2>>"$out/field.log" || { log "the rlslurm command does not start (see above)"; exit 1; }

ARGS=(--model tiny-qwen3 --device "${FIELD_DEVICE:-cuda}" --gpus-per-node 1 --trainer-procs-per-node 1
      --prompt-data src/prompts.jsonl --hf-checkpoint src/hf_init --load-debug-rollout-data src
      --num-rollout 12 --no-progress)

trained() {  # distinct rollout ids in a run's metrics
  python3 -c 'import json,sys
try: print(len({json.loads(l)["rollout_id"] for l in open(sys.argv[1]) if l.strip()}))
except FileNotFoundError: print(0)' "$1/metrics.jsonl"
}
wait_trained() {  # $1 run dir  $2 count  $3 pid that must stay alive  $4 deadline (s)
  local end=$((SECONDS + $4))
  while [ "$(trained "$1")" -lt "$2" ]; do
    kill -0 "$3" 2>/dev/null || { log "$1: rlslurm run ended before $2 rollouts"; return 1; }
    [ "$SECONDS" -ge "$end" ] && { log "$1: not $2 rollouts after $4 s"; return 1; }
    sleep 1
  done
}

log "start: straight, a (TERM to rlslurm run), b (TERM to the trainer tree)"
rlslurm run "${ARGS[@]}" --save-interval 100 --run-dir runs/straight > straight.out 2>&1 &
p_s=$!
rlslurm run "${ARGS[@]}" --save-interval 100 --run-dir runs/a > a1.out 2>&1 &
p_a=$!
rlslurm run "${ARGS[@]}" --save-interval 4 --run-dir runs/b > b1.out 2>&1 &
p_b=$!

if wait_trained runs/a 5 "$p_a" 300; then
  log "a: $(trained runs/a) trained; SIGTERM to rlslurm run ($p_a)"
  kill -TERM "$p_a"
fi
if wait_trained runs/b 5 "$p_b" 300; then
  # the trainer's launcher: rlslurm's torchrun wrapper (rlslurm/slurm/torchrun.py) or torchrun itself
  tpid=$(pgrep -f "(rlslurm[.]slurm[.]torchrun|torch[.]distributed[.]run).*$work/user/runs/b" | head -n 1)
  log "b: $(trained runs/b) trained; SIGTERM to the trainer's process group (${tpid:-NOT FOUND}: torchrun, ranks, their children)"
  if [ -n "$tpid" ]; then kill -TERM -- "-$tpid"; else log "b: no trainer process found: the check is void"; fi
fi
wait "$p_a"; rc_a1=$?
wait "$p_b"; rc_b1=$?
log "first attempts ended: a rc=$rc_a1 ($(trained runs/a) trained), b rc=$rc_b1 ($(trained runs/b) trained)"
ls runs/a/checkpoints runs/b/checkpoints 2>&1 | tee -a "$out/field.log"
# the user runs the same command again
rlslurm run "${ARGS[@]}" --run-dir runs/a > a2.out 2>&1 &
p_a2=$!
rlslurm run "${ARGS[@]}" --run-dir runs/b > b2.out 2>&1 &
p_b2=$!
wait "$p_s"; rc_s=$?
wait "$p_a2"; rc_a2=$?
wait "$p_b2"; rc_b2=$?
log "straight rc=$rc_s; a again rc=$rc_a2; b again rc=$rc_b2"

python3 "$here/tools/gpu/field_compare.py" runs/straight runs/a runs/b \
  --rc "straight=$rc_s" "a1=$rc_a1" "a2=$rc_a2" "b1=$rc_b1" "b2=$rc_b2" | tee "$out/field.json"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$out/field.log" 2>&1
tar -czf "$out/field-runs.tgz" --exclude='*.safetensors' --exclude='api_key' --exclude='*.distcp' --exclude=buffer --exclude=src \
  ./*.out runs 2>/dev/null
log "done"
