#!/usr/bin/env bash
# On the GPU machine, within a steps.sh step: bench/bench_colocate.py with the given flags, its JSON line in
# $OUT/NAME.jsonl and the run's logs and records (no weights, checkpoints, buffer or job key) in
# $OUT/NAME-runs.tgz, kept also when the run fails.
#   bash tools/gpu/colocate_bench.sh NAME [bench_colocate.py flags...]
set -uo pipefail
. tools/gpu/env.sh
out="${OUT:-/tmp/rlslurm-gpu-out}"; mkdir -p "$out"
name="${1:?usage: colocate_bench.sh NAME [FLAGS...]}"; shift
work="/tmp/rlslurm-bench-$name"
timeout "$(( ${STEP_LEFT_S:-86400} - 10 ))" python3 bench/bench_colocate.py --out "$out/$name.jsonl" --work "$work" "$@"
rc=$?
tar -C "$work" -czf "$out/$name-runs.tgz" --exclude='*.safetensors' --exclude='api_key' --exclude='*.distcp' \
  --exclude='checkpoints' --exclude='buffer' --exclude='weights' --exclude='hf_init' --exclude='hf-*' . 2>/dev/null
exit "$rc"
