"""The GPU tier's colocated runs with the defaults (test_colocate_defaults.py, test_colocate_families.py):
the command a user types on one GPU, plus only the trimmed bundle's backends (bundle_flags.py) and no
disk fallback (so that the transport each test asserts is the one that ran); and what the run's own
records say about the engines' memory share and their deaths."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.gpu.bundle_flags import run_flags

# an engine's death by CUDA OOM, as rlslurm classifies it (rlslurm/engines/engine.py)
OOM = re.compile(r"OutOfMemoryError|CUDA out of memory|out of memory|cudaErrorMemoryAllocation")


def colocated(run_dir: Path, log: Path, *flags: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rlslurm.cli", "run", "--colocate", "--device", "cuda", "--run-dir", str(run_dir),
           "--no-progress", "--weight-sync-fallback", "off", *run_flags(), *flags]
    return subprocess.Popen(cmd, stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)


def shares(run_dir: Path) -> list[dict]:
    """Every engine start's memory share as the engine's process recorded it (engines/memory_share.py)."""
    return [json.loads(line) for p in sorted(run_dir.glob("logs/attempt-*/engine-*.memory.jsonl"))
            for line in p.read_text().splitlines() if line.strip()]


def engine_text(run_dir: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(run_dir.glob("logs/attempt-*/engine-*.log")))


def rollout_text(run_dir: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(run_dir.glob("logs/attempt-*/rollout-*.log")))


def restart_causes(run_dir: Path) -> list[str]:
    """Why each engine restart happened, from the rollout logs ("engine-0-0 (url): exited (code -9); restarting")."""
    return re.findall(r"(engine-\S+ \(\S+\): [^;\n]+); restarting", rollout_text(run_dir))


def gpu_name() -> str:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=60).stdout
    return out.strip().splitlines()[0] if out.strip() else "unknown GPU"
