"""Shared by the SLURM tests (tests/slurm/test_slurm_job.py, tests/e2e): run the rlslurm CLI
and read what a submitted run leaves in its run dir (env reports, ledger)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path


def rlslurm(*args: str, cwd: Path | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    p = subprocess.run([sys.executable, "-m", "rlslurm.cli", *args], capture_output=True, text=True, cwd=cwd,
                       timeout=180)
    if check and p.returncode != 0:
        raise AssertionError(f"rlslurm {' '.join(args)} failed rc={p.returncode}\n{p.stdout}\n{p.stderr}")
    return p


def env_reports(run_dir: Path, attempt: int) -> dict[str, dict]:
    d = run_dir / "logs" / f"attempt-{attempt}"
    return {p.stem.removeprefix("env-"): json.loads(p.read_text()) for p in d.glob("env-*.json")}


def wait_reports(run_dir: Path, attempt: int, want: set[str], timeout: float = 90) -> dict[str, dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reps = env_reports(run_dir, attempt)
        if want <= set(reps):
            return reps
        time.sleep(0.5)
    logs = "\n".join(f"--- {p}\n{p.read_text()[-2000:]}" for p in sorted(run_dir.glob("logs/**/*.*")) if p.is_file())
    raise AssertionError(f"attempt {attempt}: reports {sorted(env_reports(run_dir, attempt))}, "
                         f"want {sorted(want)}\n{logs}")


def ledger(run_dir: Path) -> list[dict]:
    p = run_dir / "ledger.jsonl"
    return [json.loads(l) for l in p.read_text().splitlines()] if p.exists() else []
