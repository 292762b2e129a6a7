#!/usr/bin/env bash
# Install rlslurm with the supported GPU stack (constraints/gpu-torch211.txt: torch 2.11, megatron-core
# 0.19.2, SGLang 0.5.14, sglang-router 0.3.2, transformers 5.8.1) into a venv at $1 (default
# /opt/rlslurm), from the checkout this script is in. Run by containers/Dockerfile and
# containers/rlslurm-gpu.def; on a cluster without containers it is the same two pip commands.
set -euo pipefail
venv="${1:-/opt/rlslurm}"
cd "$(dirname "$0")/.."
constraints=constraints/gpu-torch211.txt
torch_pin="$(grep -E '^torch==' "$constraints")"  # the stack's torch, from its one file
python3 -m venv "$venv"
"$venv/bin/pip" install --no-cache-dir --upgrade pip
# CUDA 13.0 wheels of torch 2.11 (the stack's torch was measured as 2.11.0+cu130, docs/gpu.md)
"$venv/bin/pip" install --no-cache-dir "$torch_pin" --index-url https://download.pytorch.org/whl/cu130
"$venv/bin/pip" install --no-cache-dir -c "$constraints" '.[train,rollout,sglang-torch211]'
"$venv/bin/rlslurm" --version
