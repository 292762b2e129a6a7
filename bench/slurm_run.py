"""What the SLURM benches (bench_requeue.py, bench_chaos.py) share: submitting the tiny GRPO run of
tests/e2e/test_grpo_slurm.py through this checkout's `rlslurm`, and reading its batch log (its ledger:
`rlslurm.buffer.read_ledger`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def rlslurm(*args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # sbatch exports this environment to the job: its processes import this checkout's rlslurm
    # whatever the installed (editable) package points at. `env_extra` (test hooks) travels the same way.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           **(env_extra or {})}
    p = subprocess.run([sys.executable, "-m", "rlslurm.cli", *args], capture_output=True, text=True, timeout=300,
                       cwd=ROOT, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"rlslurm {' '.join(args)} failed (rc={p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def submit_tiny_grpo(run_dir: Path, prompts: Path, num_rollout: int, *extra: str, nodes: int = 2,
                     env_extra: dict[str, str] | None = None) -> int:
    """The run of tests/e2e/test_grpo_slurm.py:submit_grpo (tiny-qwen3's small default batches:
    8 prompts x 4 samples, checkpoint every 4 rollouts); returns the job id."""
    rlslurm("submit", "--model", "tiny-qwen3", "--nodes", str(nodes), "--prompt-data", str(prompts), "--run-dir",
            str(run_dir), "--gpus-per-node", "2", "--no-exclusive", "--cpus-per-node", "2", "--time", "30",
            "--signal-grace-s", "120", "--custom-rm-path", "rlslurm.demo_task:reward", "--num-rollout",
            str(num_rollout), "--num-epoch", "100", "--rollout-dtype", "float32", "--weight-sync", "distributed",
            "--verify-weight-sync", "--no-use-distributed-optimizer", "--save-interval", "4",
            "--engine-health-interval-s", "2", *extra, env_extra=env_extra)
    return int(json.loads((run_dir / "jobs.json").read_text())["jobs"][-1]["job_id"])


def batch_log_tail(run_dir: Path, job: int, n: int = 4000) -> str:
    p = run_dir / f"logs/slurm-{job}.out"
    return p.read_text(errors="replace")[-n:] if p.exists() else "(no batch log)"
