#!/usr/bin/env bash
# Installs everything the demo and the test suite need on a fresh Debian 12 / Python 3.11
# machine (root, no GPU): SLURM + munge from Debian, torch (local CPU build) first, then
# the package with its test extras, then SGLang's CPU path (see rlslurm/engines/sglang_cpu).
# With --mcore019 (tools/test.sh passes it): also .venv-mcore019, a Python 3.12 environment with
# megatron-core 0.19.2 (the GPU stack's) where tools/test.sh runs the model-family tests a second time
# (docs/megatron-versions.md). Idempotent: a second run only checks.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
log() { printf '[install] %s %s\n' "$(date +%H:%M:%S)" "$*"; }

want_slurm=1
want_sglang=1
want_mcore019=0
for a in "$@"; do
  case "$a" in
    --no-slurm) want_slurm=0 ;;
    --no-sglang) want_sglang=0 ;;
    --mcore019) want_mcore019=1 ;;
    *) echo "install.sh: unknown flag $a" >&2; exit 2 ;;
  esac
done

# apt, the main environment and .venv-mcore019 are independent and mostly wait on the network: apt and
# the second venv run in the background beside the main environment's pip, each into its own log,
# printed at the end (a failure names its part and fails the install).
bg_pids=() bg_parts=()
background() {  # background PART FUNCTION
  local logf; logf="$(mktemp -t "rlslurm-install-$1.XXXXXX")"
  "$2" >"$logf" 2>&1 &
  bg_pids+=($!) bg_parts+=("$1:$logf")
}
wait_background() {
  local rc=0 i part logf
  for i in "${!bg_pids[@]}"; do
    part="${bg_parts[$i]%%:*}" logf="${bg_parts[$i]#*:}"
    if wait "${bg_pids[$i]}"; then cat "$logf"; else rc=1; cat "$logf"; log "FAILED: $part (its output above)"; fi
    rm -f "$logf"
  done
  return "$rc"
}

install_slurm() {
  # strace: tests/trainer/test_trainer_shared_fs.py and bench/bench_fs_ops.py count run-dir file operations
  log "apt: slurmctld slurmd slurm-client munge strace"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge iproute2 procps strace >/dev/null
  log "apt: done"
}
if [ "$want_slurm" = 1 ] && ! { command -v slurmctld && command -v strace; } >/dev/null 2>&1; then
  background apt install_slurm
fi

# megatron-core 0.19.2 ships no wheel for Python 3.11 (pip there offers up to 0.16.1): the image's pyenv
# Python 3.12.1 holds it. torch and megatron-core of the GPU stack (torch 2.11.0 from PyPI, a CUDA build
# that runs on the CPU), transformers of the CPU stack: the HF reference of the parity tests, which
# the GPU stack's transformers is not for GLM-5 (docs/megatron-versions.md, "Tested"). No SGLang.
C="$here/constraints/cpu.txt"
V="$here/.venv-mcore019"
VC="$V/constraints.txt"
mcore019_ok() {
  "$V/bin/python" - "$VC" 2>/dev/null <<'PYEOF'
import sys
from importlib.metadata import version
import megatron.core, pytest, rlslurm, torch, transformers  # noqa: F401  (they import)
pins = dict(line.split("==") for line in open(sys.argv[1]).read().split() if "==" in line)
# package metadata: megatron.core.__version__ gains the hash of a git repository it sits in (this one)
sys.exit(0 if all(version(p).split("+")[0] == pins[p] for p in ("torch", "megatron-core", "transformers")) else 1)
PYEOF
}
# Its dependencies only: the editable install of this checkout writes rlslurm.egg-info here, as the main
# environment's does at the same time, so that one step waits for the end (below).
install_mcore019_deps() {
  local P312 reqs
  P312="${PYTHON312:-$(PYENV_VERSION=3.12.1 pyenv which python3.12 2>/dev/null || command -v python3.12)}"
  # (again over a venv whose creation was cut short: it has a python and no pip)
  "$V/bin/python" -m pip --version >/dev/null 2>&1 || "$P312" -m venv "$V"
  log "venv: $V ($("$P312" -V)): $(grep -E '^(torch|megatron-core|transformers)==' "$VC" | tr '\n' ' ')"
  reqs="$("$V/bin/python" -c 'import sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
print("\n".join(p["dependencies"] + p["optional-dependencies"]["train"]))' "$here/pyproject.toml")"
  mapfile -t reqs <<< "$reqs"
  "$V/bin/python" -m pip install -q --disable-pip-version-check -c "$VC" "${reqs[@]}" pytest pytest-timeout
  log "venv: dependencies done"
}
mcore019_pending=0
if [ "$want_mcore019" = 1 ]; then
  mkdir -p "$V"
  { grep -vE '^(transformers|tokenizers)==' "$here/constraints/gpu-torch211.txt"
    grep -E '^transformers==' "$C"; } > "$VC"
  if ! mcore019_ok; then mcore019_pending=1; background mcore019 install_mcore019_deps; fi
fi

pipi() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }

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

wait_background
if [ "$mcore019_pending" = 1 ]; then
  log "venv: rlslurm (editable) into $V"
  "$V/bin/python" -m pip install -q --disable-pip-version-check -c "$VC" -e "$here[train]" pytest pytest-timeout
fi
log "done"
