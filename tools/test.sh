#!/usr/bin/env bash
# The README's test commands.
#
#   bash tools/test.sh [PYTEST ARGS]          the whole suite, as CI runs it (.ci/run): install everything
#       (apt: slurm + munge; pip: torch CPU first, then the package with test extras and SGLang's CPU
#       path), boot a real SLURM cluster on this host (tests/slurm_cluster), run every test, stop the
#       cluster by pid. 1,810 tests (2026-11-28); CI ran the 1,677 before the four gated-delta and
#       sparse-attention families in 3,086 s, install included.
#       Then the model-family tests (FAMILY_TESTS) a second time on megatron-core 0.19.2, in
#       .venv-mcore019 (tools/install.sh --mcore019; docs/megatron-versions.md), without PYTEST ARGS;
#       the exit status is the first run's when it failed, else the second's, else the lint's.
#   bash tools/test.sh --quick [PYTEST ARGS]  the quick lane: every test that needs no SLURM cluster and
#       starts no SGLang engine, no megatron-core run and nothing marked slow (QUICK below). No install
#       step: run the full command or tools/install.sh once first. Under 5 min on 2 cores (README).
#       The exit status is pytest's when it failed, else the lint's.
# Both start with the lint (lint below: ruff, configured in pyproject.toml, pinned in its test extras). A lint
# finding fails the run but does not stop the tests: their results are reported either way.
set -euo pipefail
cd "$(dirname "$0")/.."

# pytest markers (pyproject.toml): what the quick lane leaves out
QUICK="not slurm and not sglang and not megatron and not slow"

# Every model family on megatron-core 0.19.2 (the GPU stack's): TransformerConfig and layer spec of each,
# then build, HF parity (logits, log-probs, gradients), one clipped optimizer step and the bit-exact export
# of each at TP 1, TP 2 and EP 2; `rlslurm convert` round trips (qwen3, glm4, deepseek-v3, minimax-m2,
# qwen3-next, glm-moe-dsa); the trainer's own steps (tiny-qwen3 at TP 1, TP 2 packed, DP 2); rlslurm's
# gated delta kernels and the CPU shim. tests/convert before tests/trainer: a test module's
# `from conftest import` gets the conftest pytest loaded last.
FAMILY_TESTS=(
  tests/convert/test_model_build.py
  tests/convert/test_convert_parity.py
  tests/convert/test_convert_cli.py
  tests/convert/test_cpu_shim.py
  tests/trainer/test_gated_delta.py
  tests/trainer/test_trainer_step.py
)

# ruff over the whole tree (pyproject.toml [tool.ruff]; .pre-commit-config.yaml runs the same). Sets rc_lint.
lint() {
  set +e
  python3 -m ruff check .
  rc_lint=$?
  set -e
  echo "[test] lint (ruff check .): exit $rc_lint"
}

if [ "${1:-}" = "--quick" ]; then
  shift
  lint
  set +e
  python3 -m pytest tests -m "$QUICK" --durations=15 "$@"
  rc=$?
  set -e
  [ "$rc" -ne 0 ] && exit "$rc"
  exit "$rc_lint"
fi

bash tools/install.sh --mcore019
export RLSLURM_REQUIRE_SLURM=1
lint
set +e
python3 -m pytest tests --durations=30 "$@"  # the slowest tests, to bring the suite under 55 min
rc=$?
start=$(date +%s)
PYTHONPATH="$PWD" .venv-mcore019/bin/python -m pytest "${FAMILY_TESTS[@]}" --durations=10  # PYTEST ARGS: first run only
rc019=$?
echo "[test] the model-family tests on megatron-core 0.19.2 (.venv-mcore019): exit $rc019 in $(( $(date +%s) - start )) s"
set -e
# pytest exit 5 = no tests collected: that is a failure here, never a silent pass.
[ "$rc" -ne 0 ] && exit "$rc"
[ "$rc019" -ne 0 ] && exit "$rc019"
exit "$rc_lint"
