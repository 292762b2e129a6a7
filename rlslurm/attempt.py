"""One attempt of a run (one start of its processes; rlslurm/buffer/attempts.py numbers them),
described once for both of its runners: the batch script (rlslurm/templates/hetjob.sbatch.j2) and
`rlslurm run` (rlslurm/local.py).

`rlslurm run` calls this module. The batch script runs no Python of its own: on the batch host the
nodes' interpreter may not exist at all (it may live only in the steps' container, or appear only
after --setup-script, whose failure must be the attempt's recorded failure, not a silent start). So
rlslurm/slurm/render.py renders what the script shares with this module into it: the stale records it
removes, the format of its ledger and start lines, and the command each step runs.
tests/launcher/test_attempt.py runs the rendered script's start next to `begin` and compares them.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rlslurm.buffer.atomic import LOG_DIR_MODE, LOG_FILE_MODE, append_line, exists_fresh
from rlslurm.buffer.attempts import is_event
from rlslurm.buffer.ledger import read_ledger
from rlslurm.buffer.rundir import RunDir

Role = Literal["trainer", "rollout"]

# Under RUN/control/: what the previous attempt's processes recorded. This attempt must not take them
# for its own (the trainer would sync weights into engines that no longer exist). A stop request
# (stop.json, stop_ack.json) is not among them: it outlives attempts until the user continues the run
# (`rlslurm run` / `rlslurm resubmit` clear it, rlslurm/cli.py).
STALE_RECORDS = ("preempt.json", "preempt_ack.json", "engines.json", "engines-node*.json", "router.json",
                 "weight_update.json", "colocate_turn.json", "colocate_memory.json", "rendezvous-*.json",
                 "heartbeats/*.json")

# Reasons of the attempts that end before their processes start, and of those that left no line.
FINISHED = "finished"
STOPPED = "stopped by request"
LOST = "lost: no end record (node failure or hard kill)"
LOST_EXIT_CODE = -1

# The fields of a ledger line and of logs/attempt-N/attempt.json, in order. The batch script writes
# them with printf (`printf_format`), so only numbers and strings that need no JSON escaping.
LEDGER_FIELDS: tuple[tuple[str, type], ...] = (
    ("attempt", int), ("job_id", str), ("restart_count", int), ("start", int), ("end", int),
    ("exit_code", int), ("reason", str), ("trainer_nodes", str), ("rollout_nodes", str), ("checkpoint", int))
START_FIELDS: tuple[tuple[str, type], ...] = (
    ("attempt", int), ("job_id", str), ("start", int), ("trainer_nodes", str), ("rollout_nodes", str))

LOCAL = "local"  # job id and node lists of an `rlslurm run` attempt


def printf_format(fields: tuple[tuple[str, type], ...]) -> str:
    """The printf format (with its trailing `\\n` escape) that writes `fields` as `json.dumps` would."""
    return "{" + ", ".join(f'"{k}": ' + ("%d" if t is int else '"%s"') for k, t in fields) + "}\\n"


def _record(fields: tuple[tuple[str, type], ...], **values: Any) -> dict[str, Any]:
    assert set(values) == {k for k, _ in fields}, sorted(values)
    assert all(isinstance(values[k], t) for k, t in fields), values
    return {k: values[k] for k, _ in fields}


@dataclass(frozen=True)
class Attempt:
    number: int
    job_id: str         # SLURM_JOB_ID (the het job's leader); LOCAL under `rlslurm run`
    start: int          # epoch seconds
    trainer_nodes: str  # SLURM_JOB_NODELIST_HET_GROUP_0; LOCAL under `rlslurm run`
    rollout_nodes: str  # SLURM_JOB_NODELIST_HET_GROUP_1; LOCAL under `rlslurm run`

    def start_record(self) -> dict[str, Any]:
        return _record(START_FIELDS, attempt=self.number, job_id=self.job_id, start=self.start,
                       trainer_nodes=self.trainer_nodes, rollout_nodes=self.rollout_nodes)

    def ledger_record(self, end: int, exit_code: int, reason: str, *, checkpoint: int = 0, number: int | None = None,
                      start: int | None = None) -> dict[str, Any]:
        """This attempt's ledger line; with `number` and `start`, the line it writes for an earlier
        attempt that left none (its job id and nodes are this attempt's: nothing else is known).
        `checkpoint`: `checkpoint_reached` when the line is written."""
        n = self.number if number is None else number
        return _record(LEDGER_FIELDS, attempt=n, job_id=self.job_id, restart_count=n,
                       start=self.start if start is None else start, end=end, exit_code=exit_code,
                       reason=reason, trainer_nodes=self.trainer_nodes, rollout_nodes=self.rollout_nodes,
                       checkpoint=checkpoint)


def checkpoint_reached(rd: RunDir) -> int:
    """The iteration `checkpoints/latest` names, 0 before the first: what the run has kept. Each ledger
    line carries it, and the failure budget counts the failed attempts since it last moved
    (buffer/attempts.py). The batch script reads it the same way (`checkpoint_reached`)."""
    try:
        name = json.loads((rd.checkpoints_dir / "latest").read_text())["name"]
        return int(str(name).removeprefix("iter_"))
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def append_ledger(rd: RunDir, rec: dict[str, Any]) -> None:
    """One ledger line (single writer at a time: the attempt's runner), whole or absent; a refused
    append raises a StorageError naming the ledger (the batch script checks its appends the same
    way: a failure the ledger does not count must not be followed by another attempt)."""
    append_line(rd.ledger, (json.dumps(rec) + "\n").encode(), f"attempt {rec.get('attempt')}'s ledger line")


def end(rd: RunDir, a: Attempt, exit_code: int, reason: str) -> None:
    append_ledger(rd, a.ledger_record(int(time.time()), exit_code, reason, checkpoint=checkpoint_reached(rd)))


def record_lost(rd: RunDir, a: Attempt) -> list[int]:
    """Ledger lines for the earlier attempts that started (their log directory exists) and never
    wrote their own (node failure, SIGKILL). Returns their numbers."""
    ended = {r.get("attempt") for r in read_ledger(rd) if not is_event(r)}
    lost = [n for n in range(a.number) if n not in ended and rd.attempt_log_dir(n).is_dir()]
    for n in lost:
        started = int(rd.attempt_log_dir(n).stat().st_mtime)
        append_ledger(rd, a.ledger_record(a.start, LOST_EXIT_CODE, LOST, number=n, start=started,
                                          checkpoint=checkpoint_reached(rd)))
    return lost


def clear_stale(rd: RunDir) -> None:
    for pattern in STALE_RECORDS:
        for f in rd.control_dir.glob(pattern):
            f.unlink(missing_ok=True)


def begin(rd: RunDir, a: Attempt) -> str | None:
    """Start attempt `a`: its log directory and start record, lines for lost earlier attempts, no
    stale record left. Returns why it ends before its processes start (FINISHED, STOPPED), else None;
    the caller then writes its line with `end`."""
    logs = rd.attempt_log_dir(a.number)
    for d in (logs, rd.control_dir):  # as `mkdir -p` under the batch script's umask 077
        if not d.is_dir():
            d.mkdir(mode=LOG_DIR_MODE, parents=True, exist_ok=True)
            os.chmod(d, LOG_DIR_MODE)
    record_lost(rd, a)
    fd = os.open(logs / "attempt.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, LOG_FILE_MODE)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(a.start_record()) + "\n")
    clear_stale(rd)
    if rd.is_finished():
        return FINISHED
    if exists_fresh(rd.control_dir / "stop.json"):
        return STOPPED
    return None


# --- the roles' command lines ------------------------------------------------------------------------

def trainer_argv(run_dir: Path | str, *, nnodes: int, node_rank: int, procs_per_node: int, master_addr: str,
                 master_port: int | str, shutdown_timeout_s: int, python: str = sys.executable) -> list[str]:
    """One node's trainer: torchrun with its rendezvous store bound to the master address
    (rlslurm/slurm/torchrun.py). `shutdown_timeout_s` (the run's --signal-grace-s): how long torchrun
    lets the ranks finish their checkpoint after a TERM before it KILLs them (torch's default, 30 s,
    is shorter than a real model's save)."""
    return [python, "-m", "rlslurm.slurm.torchrun", f"--nnodes={nnodes}", f"--node-rank={node_rank}",
            f"--nproc-per-node={procs_per_node}", f"--master-addr={master_addr}", f"--master-port={master_port}",
            f"--shutdown-timeout={shutdown_timeout_s}", "-m", "rlslurm.trainer.main", "--run-dir", str(run_dir)]


def rollout_argv(run_dir: Path | str, *, trainer_addr: str, python: str = sys.executable) -> list[str]:
    """One node's rollout group (engines, router on the first node, driver)."""
    return [python, "-m", "rlslurm.rollout.main", "--run-dir", str(run_dir), "--trainer-addr", trainer_addr]


def step_argv(role: Role, *, python: object, run_dir: object, master_addr: object, master_port: object) -> list[object]:
    """What every node of the role's het group runs in the batch script: rlslurm/slurm/launch.py, which
    takes the node's rank from the SLURM step and execs `trainer_argv` / `rollout_argv`. The values may
    be the script's variables (render.py quotes each word)."""
    return [python, "-m", "rlslurm.slurm.launch", role, "--run-dir", run_dir, "--master-addr", master_addr,
            "--master-port", master_port]
