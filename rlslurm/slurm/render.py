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

from rlslurm import attempt
from rlslurm.errors import ConfigError
from rlslurm.settings.config import RunConfig
from rlslurm.user_error import FAILURE_FILE, USER_ERROR_EXIT_CODE, USER_ERROR_FILE
from rlslurm.watchdog import CHECK_EVERY_S, hang_timeout_s

TEMPLATE_DIR = Path(__file__).resolve().parents[1] / "templates"
TEMPLATE = "hetjob.sbatch.j2"


@dataclass(frozen=True)
class ShellVar:
    """A word of a rendered command that is one of the script's variables: "$NAME"."""
    name: str


def shell_words(words: list[object]) -> str:
    """One command line: the script's variables double-quoted, every other word shell-quoted."""
    return " ".join(f'"${w.name}"' if isinstance(w, ShellVar) else shlex.quote(str(w)) for w in words)


def stale_records(control_var: str = "CONTROL") -> str:
    """attempt.STALE_RECORDS as `rm` arguments: each name quoted, only a pattern's glob left outside."""
    out = []
    for pattern in attempt.STALE_RECORDS:
        if not re.fullmatch(r"[A-Za-z0-9_.*/-]+", pattern):  # nothing the shell would read twice
            raise ValueError(f"stale record {pattern!r}: not a plain name or glob")
        out.append(f'"${control_var}"/{pattern}' if "*" in pattern else f'"${control_var}/{pattern}"')
    return " ".join(out)


def _fixed_text(text: str) -> str:
    """One of our own fixed strings, double-quoted as the script's other reasons are: nothing in it
    that the shell would expand or JSON would escape."""
    if not re.fullmatch(r"[A-Za-z0-9 :;,()._/+-]*", text):
        raise ValueError(f"{text!r}: not a plain fixed text")
    return f'"{text}"'


def _attempt_values() -> dict[str, object]:
    """What the script's attempt lines take from rlslurm/attempt.py (see its docstring)."""
    step = {role: shell_words(attempt.step_argv(role, python=ShellVar("PYTHON"), run_dir=ShellVar("RUN_DIR"),
                                                master_addr=ShellVar("TRAINER_ADDR"),
                                                master_port=ShellVar("TRAINER_PORT")))
            for role in ("trainer", "rollout")}
    return dict(stale_records=stale_records(), step_command=step,
                ledger_format=shlex.quote(attempt.printf_format(attempt.LEDGER_FIELDS)),
                start_format=shlex.quote(attempt.printf_format(attempt.START_FIELDS)),
                reason=dict(finished=_fixed_text(attempt.FINISHED), stopped=_fixed_text(attempt.STOPPED),
                            lost=_fixed_text(attempt.LOST)),
                lost_exit_code=attempt.LOST_EXIT_CODE)


@dataclass(frozen=True)
class Group:
    nodes: int
    gpus_per_node: int
    partition: str | None
    extra: tuple[str, ...] = ()   # --sbatch-extra and the group's own extra options (config.py says why)


@dataclass(frozen=True)
class Step:
    """One role's srun: which part of the allocation (`--het-group=N`, or `--overlap` on one node),
    its node count, and the variable SLURM lists its nodes in."""
    select: str
    nodes: int
    nodelist: str


def _extra(*lists: list[str]) -> tuple[str, ...]:
    """A component's extra options: the common ones, then its group's; each once, in order (the one
    group of a --nodes 1 or --colocate job runs both roles, so it takes both groups' options)."""
    return tuple(dict.fromkeys(opt for opts in lists for opt in opts))


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
    # A replay (--load-debug-rollout-data) or --debug-train-only (SFT) starts no engine: the rollout
    # group only waits or tokenizes, and must not hold a node's GPUs for it.
    engines = not cfg.starts_no_engines
    if cfg.single_node or cfg.run.colocate:
        # One group; both steps start with --overlap, which shares every resource of the nodes
        # (CPUs, memory, GPUs: SLURM 22.05 srun(1)). On one node each role picks its own GPUs of
        # the job's (rlslurm/gpus.py); colocated, both use all of them on every node. A het job
        # would not be sure to put two components on the same nodes.
        groups = [Group(nodes=s.nodes, gpus_per_node=gpus,
                        partition=s.trainer_partition or s.rollout_partition or s.partition,
                        extra=_extra(s.sbatch_extra, s.trainer_sbatch_extra, s.rollout_sbatch_extra))]
        steps = {role: Step("--overlap", s.nodes, "SLURM_JOB_NODELIST") for role in ("trainer", "rollout")}
    else:
        groups = [
            Group(nodes=s.trainer_nodes or 1, gpus_per_node=gpus, partition=s.trainer_partition or s.partition,
                  extra=_extra(s.sbatch_extra, s.trainer_sbatch_extra)),
            Group(nodes=s.rollout_nodes or 1, gpus_per_node=gpus if engines else 0,
                  partition=s.rollout_partition or s.partition, extra=_extra(s.sbatch_extra, s.rollout_sbatch_extra)),
        ]
        steps = {role: Step(f"--het-group={i}", g.nodes, f"SLURM_JOB_NODELIST_HET_GROUP_{i}")
                 for i, (role, g) in enumerate(zip(("trainer", "rollout"), groups))}
    return _env().get_template(TEMPLATE).render(
        job_name=job_name(cfg.run.run_name),
        slurm=s,
        groups=groups,
        steps=steps,
        run_dir=str(run_dir.resolve()),
        attempt_base=attempt_base,
        user_error_exit=USER_ERROR_EXIT_CODE, user_error_file=USER_ERROR_FILE, failure_file=FAILURE_FILE,
        hang_timeout_s=int(hang_timeout_s(cfg.train)),
        hang_check_every_s=int(CHECK_EVERY_S),
        **_attempt_values(),
    )
