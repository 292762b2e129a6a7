"""Render the heterogeneous sbatch script from `rlslurm/templates/hetjob.sbatch.j2` (package data).

Quoting policy: SLURM directives only carry values validated as plain SLURM names/numbers
(config.py); every other user value reaches the shell body through the `q` filter
(`shlex.quote`). Passthrough args, prompt paths and the like never enter the script at all:
the processes read them from RUN/run.yaml.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import jinja2

from rlslurm.config import RunConfig
from rlslurm.errors import ConfigError
from rlslurm.user_error import USER_ERROR_EXIT_CODE, USER_ERROR_FILE
from rlslurm.watchdog import hang_timeout_s

TEMPLATE_DIR = Path(__file__).resolve().parents[1] / "templates"
TEMPLATE = "hetjob.sbatch.j2"


@dataclass(frozen=True)
class Group:
    nodes: int
    gpus_per_node: int
    partition: str | None


def job_name(run_name: str) -> str:
    """A directive-safe job name; the exact run name lives in run.yaml."""
    return (re.sub(r"[^A-Za-z0-9_.-]+", "_", run_name).strip("_") or "rlslurm")[:64]


def _env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE_DIR),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
    )
    env.filters["q"] = lambda v: shlex.quote(str(v))
    return env


def render(cfg: RunConfig, run_dir: Path, attempt_base: int = 0) -> str:
    """`attempt_base`: the job's first attempt number (`rlslurm resubmit`: the run's next free one)."""
    s = cfg.slurm
    if not isinstance(attempt_base, int) or attempt_base < 0:
        raise ConfigError(f"attempt base must be an integer >= 0, got {attempt_base!r}")
    if cfg.run.shared_gpu:
        raise ConfigError("--shared-gpu is for `rlslurm run` on one machine: a SLURM job gives the trainer and the "
                          "rollout engines nodes of their own")
    if "%" in str(run_dir):
        # srun/sbatch expand %j, %t, ... in --output paths.
        raise ConfigError(f"--run-dir {str(run_dir)!r}: '%' is not allowed in the run directory path")
    gpus = s.gpus_per_node
    groups = [
        Group(nodes=s.trainer_nodes or 1, gpus_per_node=gpus, partition=s.trainer_partition or s.partition),
        Group(nodes=s.rollout_nodes or 1, gpus_per_node=gpus, partition=s.rollout_partition or s.partition),
    ]
    return _env().get_template(TEMPLATE).render(
        job_name=job_name(cfg.run.run_name),
        slurm=s,
        groups=groups,
        run_dir=str(run_dir.resolve()),
        attempt_base=attempt_base,
        user_error_exit=USER_ERROR_EXIT_CODE, user_error_file=USER_ERROR_FILE,
        hang_timeout_s=int(hang_timeout_s(cfg.train)),
    )
