#!/usr/bin/env bash
# Installs everything the demo and the test suite need on a fresh Debian 12 / Python 3.11
# machine (root, no GPU): SLURM + munge from Debian, torch (local CPU build) first, then
# the package with its test extras, then SGLang's CPU path (see rlslurm/engines/sglang_cpu).
# Idempotent: a second run only checks.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
log() { printf '[install] %s %s\n' "$(date +%H:%M:%S)" "$*"; }

want_slurm=1
want_sglang=1
for a in "$@"; do
  case "$a" in
    --no-slurm) want_slurm=0 ;;
    --no-sglang) want_sglang=0 ;;
    *) echo "install.sh: unknown flag $a" >&2; exit 2 ;;
  esac
done

if [ "$want_slurm" = 1 ] && ! { command -v slurmctld && command -v strace; } >/dev/null 2>&1; then
  # strace: tests/trainer/test_trainer_shared_fs.py and bench/bench_fs_ops.py count run-dir file operations
  log "apt: slurmctld slurmd slurm-client munge strace"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge iproute2 procps strace >/dev/null
fi

pipi() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }
C="$here/constraints/cpu.txt"

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null; then
  log "pip: torch==2.13.0 (local CPU build)"
  pipi torch==2.13.0
fi
log "pip: rlslurm[test]"
pipi -c "$C" -e "$here[test]"

if [ "$want_sglang" = 1 ]; then
  if ! "$PY" -c 'import sglang, sys; sys.exit(0 if sglang.__version__ == "0.5.23" else 1)' 2>/dev/null; then
    log "pip: sglang==0.5.23 --no-deps + CPU dependency set"
    pipi --no-deps sglang==0.5.23
    pipi -c "$C" -r "$here/tools/sglang-cpu-requirements.txt"
    # A CUDA torchvision breaks `import sglang` on CPU torch; the shim provides an import-only stub.
    "$PY" -m pip uninstall -y -q torchvision 2>/dev/null || true
  fi
fi
log "done"
