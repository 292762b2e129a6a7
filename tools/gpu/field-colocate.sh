#!/usr/bin/env bash
# The colocate field check, on one GPU: what a user does, not what the test suite does.
#   - rlslurm from a plain wheel install (not this checkout), run from another directory, relative
#     --run-dir;
#   - `rlslurm run --demo --colocate` (trainer and engine taking turns on the GPU, weights by CUDA IPC);
#   - kill -9 of `rlslurm run` itself after 3 trained rollouts: its trainer, rollout and engine must end
#     by themselves (rlslurm/owned_role.py, engines/owner_watch.py), within the stop grace;
#   - the same command again: resumes from the TERM's checkpoint and finishes; every sync read in place,
#     every probe at the trainer's version.
# Inputs: .field/ with the rlslurm wheel and deps/ (tools/gpu/field-inputs.sh, or just its wheel and
# deps lines); both bundle parts staged (SGLang: tools/gpu/stage.sh .gpu-bundle/p1, then p2).
# Writes $OUT/field-colocate.log and $OUT/field-colocate-runs.tgz.
set -uo pipefail
here=$(pwd)
field="$here/.field"
prefix="${RLSLURM_GPU_PREFIX:-/tmp/rlslurm-gpu}"
work=/tmp/rlslurm-field-colocate
out="${OUT:-$work/out}"
rm -rf "$work"
mkdir -p "$work/user" "$out"
log() { printf '[field-colocate %s] %s\n' "$(date +%H:%M:%S)" "$*" | tee -a "$out/field-colocate.log"; }

. "$here/tools/gpu/field-install.sh"
cd "$work/user"
log "rlslurm imported from $(python3 -c 'import rlslurm; print(rlslurm.__file__)')"

run=runs/colo
abs="$work/user/$run"
ARGS=(--demo --colocate --device cuda --gpus-per-node 1 --trainer-procs-per-node 1 --num-rollout 8
      --save-interval 100 --signal-grace-s 120 --verify-weight-sync --rollout-dtype bfloat16 --no-progress
      --sglang-attention-backend triton --sglang-sampling-backend pytorch --sglang-disable-cuda-graph
      --sglang-grammar-backend none --sglang-mem-fraction-static 0.3 --run-dir "$run")
trained() {
  python3 -c 'import json,sys
try: print(len({json.loads(l)["rollout_id"] for l in open(sys.argv[1]) if l.strip()}))
except FileNotFoundError: print(0)' "$abs/metrics.jsonl"
}
procs() { pgrep -f -- "$abs" | grep -v "^$$\$" || true; }

rlslurm run "${ARGS[@]}" > first.out 2>&1 &
p=$!
end=$((SECONDS + 400))
while [ "$(trained)" -lt 3 ]; do
  kill -0 "$p" 2>/dev/null || { log "rlslurm run ended before 3 rollouts: $(tail -n 5 first.out)"; exit 1; }
  [ "$SECONDS" -ge "$end" ] && { log "not 3 rollouts after 400 s"; kill -9 "$p"; exit 1; }
  sleep 1
done
log "$(trained) trained; processes of the run: $(procs | wc -l); kill -9 of rlslurm run ($p)"
kill -9 "$p"
t0=$SECONDS
while [ -n "$(procs)" ] && [ $((SECONDS - t0)) -lt 200 ]; do sleep 1; done
left=$(procs | wc -l)
log "after the kill -9: $left process(es) of the run left after $((SECONDS - t0)) s; $(trained) trained"
[ "$left" -eq 0 ] || { ps -o pid,pgid,args -p "$(procs | paste -sd, -)" | cut -c1-200 | tee -a "$out/field-colocate.log"; }
ls "$abs/checkpoints" 2>&1 | tee -a "$out/field-colocate.log"

rlslurm run "${ARGS[@]}" > second.out 2>&1
rc=$?
log "the same command again: rc=$rc; $(tail -n 3 second.out | tr '\n' ' ')"
python3 - "$abs" <<'EOF' | tee -a "$out/field-colocate.log"
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
per = {}
for line in (run / "metrics.jsonl").read_text().splitlines():
    r = json.loads(line)
    ids = per.setdefault(r["attempt"], [])
    if not ids or ids[-1] != r["rollout_id"]:
        ids.append(r["rollout_id"])
probes = [json.loads(l) for l in (run / "control/weight_probe.jsonl").read_text().splitlines()]
logs = "".join(p.read_text(errors="replace") for p in run.glob("logs/attempt-*/engine-*.log"))
tlogs = "".join(p.read_text(errors="replace") for p in run.glob("logs/attempt-*/trainer-*.log"))
print(json.dumps({
    "trained_per_attempt": per, "finished": (run / "FINISHED").exists(),
    "probes": len(probes), "probes_at_version": sum(all(str(e.get("weight_version")) == str(p["version"])
                                                         for e in p["engines"].values()) and bool(p["engines"])
                                                     for p in probes),
    "probes_greedy_equal": sum(bool(p["match"]) for p in probes),
    "engine_reads_in_place": logs.count("read in place"), "engine_broadcast_reads": logs.count("broadcast, "),
    "trainer_copied_in_place": tlogs.count("copied in place"),
}))
EOF
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$out/field-colocate.log" 2>&1
tar -czf "$out/field-colocate-runs.tgz" --exclude='*.safetensors' --exclude='api_key' --exclude='*.distcp' --exclude=buffer \
  --exclude=checkpoints --exclude=weights ./*.out runs 2>/dev/null
log "done"
exit "$rc"
