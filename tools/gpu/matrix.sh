#!/usr/bin/env bash
# On the 4-GPU machine, once every bundle part is staged (tools/gpu/stage.sh): the GPU layout matrix
# (tests/gpu/test_layouts.py: trainer TP2 + TP2 engine, DP2 + two engines, PP2 + one engine) and the
# colocated TP2 engine (test_gpu_grpo.py, RLSLURM_GPU_ENGINE_TP=2), within BUDGET_S seconds (default
# 540). Into $OUT: the GPUs (gpus.txt), the pytest log (matrix.log) and the runs' own records
# (matrix-runs.tgz: env-*.json, metrics.jsonl, control/, logs; no weights, checkpoints or buffer).
set -uo pipefail
. tools/gpu/env.sh
out="${OUT:-/tmp/rlslurm-gpu-out}"; mkdir -p "$out"
base=/tmp/rlslurm-gpu-matrix; rm -rf "$base"
nvidia-smi --query-gpu=index,name,uuid,pci.bus_id --format=csv,noheader | tee "$out/gpus.txt"
RLSLURM_GPU_ENGINE_TP=2 timeout "${BUDGET_S:-540}" python3 -m pytest -v -s -p no:cacheprovider --basetemp="$base" \
  tests/gpu/test_layouts.py \
  "tests/gpu/test_gpu_grpo.py::test_colocate_takes_turns_frees_the_engines_memory_and_kill9_resumes" "$@" \
  2>&1 | tee "$out/matrix.log"
rc=${PIPESTATUS[0]}
tar -C "$base" -czf "$out/matrix-runs.tgz" --exclude='*.safetensors' --exclude='api_key' --exclude='checkpoints' --exclude='buffer' \
  --exclude='weights' --exclude='hf_init' . 2>/dev/null
exit "$rc"
