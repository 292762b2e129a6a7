#!/usr/bin/env bash
# On the GPU machine, from the checkout's root, once every part is staged: the GPU tier (tests/gpu).
# Output and the tier's run directories' logs go to ${OUT:-/tmp/rlslurm-gpu-out}.
set -uo pipefail
. tools/gpu/env.sh
out="${OUT:-/tmp/rlslurm-gpu-out}"; mkdir -p "$out"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
python3 -c 'import torch, sglang, sglang_router, megatron.core as m; print("torch", torch.__version__, "sglang", sglang.__version__, "megatron-core", m.__version__, "gpus", torch.cuda.device_count())'
base=/tmp/rlslurm-gpu-tier; rm -rf "$base"
python3 -m pytest tests/gpu -v -s -p no:cacheprovider --basetemp="$base" "$@" 2>&1 | tee "$out/tier.log"
rc=${PIPESTATUS[0]}
# the runs' logs and records (not weights, checkpoints or the buffer), as one file
tar -C "$base" -czf "$out/tier-runs.tgz" --exclude='*.safetensors' --exclude='checkpoints' --exclude='buffer' . 2>/dev/null
exit "$rc"
