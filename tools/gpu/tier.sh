#!/usr/bin/env bash
# On the GPU machine, from the checkout's root, once every part is staged: the GPU tier (tests/gpu), or
# the tests given. Output goes to ${OUT:-/tmp/rlslurm-gpu-out}: NAME.log (pytest's) and NAME-runs.tgz (the
# runs' logs and records, not weights, checkpoints or the buffer), NAME from TIER_NAME (default: tier).
#   bash tools/gpu/tier.sh                                  the whole tier
#   TIER_NAME=families bash tools/gpu/tier.sh tests/gpu/test_colocate_families.py -k qwen3
set -uo pipefail
. tools/gpu/env.sh
out="${OUT:-/tmp/rlslurm-gpu-out}"; mkdir -p "$out"
name="${TIER_NAME:-tier}"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
python3 -c 'import torch, sglang, sglang_router, megatron.core as m; print("torch", torch.__version__, "sglang", sglang.__version__, "megatron-core", m.__version__, "gpus", torch.cuda.device_count())'
base="/tmp/rlslurm-gpu-$name"; rm -rf "$base"
[ $# -gt 0 ] || set -- tests/gpu
# within a steps.sh step, stop pytest before the step's own timeout so that the runs' records are packed
log="$out/$name.log"
# under steps.sh with the same NAME, stdout is that log already: a second writer would interleave it
[ /dev/stdout -ef "$log" ] && log=/dev/null
timeout "${STEP_LEFT_S:-86400}" python3 -m pytest -v -s -p no:cacheprovider --basetemp="$base" "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
tar -C "$base" -czf "$out/$name-runs.tgz" --exclude='*.safetensors' --exclude='api_key' --exclude='*.distcp' --exclude='checkpoints' \
  --exclude='buffer' --exclude='weights' --exclude='hf_init' . 2>/dev/null
exit "$rc"
