#!/usr/bin/env bash
# Here (CPU machine): build the field check's inputs into .field/ (git-ignored, carried to the GPU
# machine): the rlslurm wheel and a replay source, the buffer of a CPU run of the demo task.
#   rlslurm run --demo --run-dir /tmp/field-src --num-rollout 12 --keep-trained-rollouts 100 --no-progress
#   bash tools/gpu/field-inputs.sh /tmp/field-src
set -euo pipefail
src="${1:?usage: field-inputs.sh SOURCE_RUN_DIR (a finished CPU run that kept its trained rollouts)}"
cd "$(dirname "$0")/../.."
rm -rf .field && mkdir -p .field
python3 -m pip wheel -q --no-deps --no-build-isolation -w .field .
rm -rf build  # setuptools leaves its staging tree in the checkout
# the CLI's dependencies the GPU image lacks (it has no typer: measured 2026-11-23, docs/gpu.md)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform any \
  -d .field/deps typer annotated-doc click shellingham rich markdown-it-py mdurl pygments typing-extensions
n=$(ls "$src"/buffer/train 2>/dev/null | grep -c '\.manifest' || true)
echo "replay source $src: $n committed rollouts"
tar -czf .field/replay.tgz -C "$src" --transform 's,^\.,src,' ./buffer ./prompts.jsonl ./hf_init
du -sh .field/*
