"""Each process of the het job records where it runs: RUN/logs/attempt-N/env-<role>-<rank>.json.

`rlslurm status`, the tests and a human debugging a hang read these to see which node, GPUs and
rendezvous every process actually got.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rlslurm.buffer.atomic import write_json_atomic
from rlslurm.buffer.rundir import RunDir
from rlslurm.job.env import job_env


def write_env_report(run_dir: Path, role: str, rank: int, extra: dict[str, Any]) -> Path:
    env = job_env()
    rd = RunDir(run_dir)
    path = rd.attempt_log_dir(env.attempt) / f"env-{role}-{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {"role": role, "rank": rank, "pid": os.getpid(), **env.as_dict(), **extra})
    return path
