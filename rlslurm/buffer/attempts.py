"""Attempt numbers and the failure budget across the jobs of one run.

An attempt is one start of the run's processes: a SLURM job's first run or one of its requeues,
or one `rlslurm run`. Its number names logs/attempt-N/, its ledger line, its weight-sync
rendezvous record (control/rendezvous-N.json, created O_EXCL) and its metrics lines, so it must
never repeat within a run. SLURM_RESTART_COUNT starts at 0 in every job: `rlslurm resubmit`
therefore renders the job script with the next free number as its base, and the job's attempt is
base + SLURM_RESTART_COUNT (rlslurm/templates/hetjob.sbatch.j2).

The batch script gives up after `--max-failures` failed attempts in a row without progress: the
count restarts whenever the run's checkpoint has moved on (each ledger line carries the iteration
`checkpoints/latest` named at its end, rlslurm/attempt.py `checkpoint_reached`). A week-long run
then survives a node failure a day, each resumed from a newer checkpoint, while a run that fails
again and again from the same checkpoint (a bug, a broken node) stops after the budget. A resubmit
writes a `resubmitted` record into the ledger; with `--reset-failures` it also restarts the count
from there. Without it the count stands: a run that used up its budget ends at its next failure
unless it checkpoints first.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from rlslurm.buffer.ledger import read_ledger
from rlslurm.buffer.rundir import RunDir
from rlslurm.buffer.store import as_rundir

RESUBMITTED = "resubmitted"
# What the batch script greps for, in the JSON exactly as `json.dumps` and its printf write it.
FAILED_MARK = '"reason": "failed'
RESET_MARK = '"reset_failures": true'


def is_event(rec: dict[str, Any]) -> bool:
    """A ledger record that is not an attempt (a resubmit)."""
    return "event" in rec


def attempt_numbers(run: RunDir | str | Path) -> list[int]:
    """Every attempt number the run has used: logs/attempt-N directories and ledger lines."""
    rd = as_rundir(run)
    used = {int(p.name.split("-")[-1]) for p in rd.logs_dir.glob("attempt-*") if p.name.split("-")[-1].isdigit()}
    used |= {int(r["attempt"]) for r in read_ledger(rd) if not is_event(r) and isinstance(r.get("attempt"), int)}
    return sorted(used)


class AttemptSuperseded(Exception):
    """A later attempt of the run has started: this process outlived its own attempt (`rlslurm run`
    killed -9 alone, a node cut off but still running) and must leave the run to it."""


def superseded(run: RunDir | str | Path, attempt: int) -> bool:
    """Has an attempt after `attempt` started? Its logs/attempt-N directory exists before any of its
    processes run (the batch script and `rlslurm run` create it first)."""
    return any(a > attempt for a in attempt_numbers(run))


def next_attempt(run: RunDir | str | Path) -> int:
    used = attempt_numbers(run)
    return used[-1] + 1 if used else 0


def failures_counted(records: list[dict[str, Any]]) -> int:
    """Failed attempts that count against --max-failures: those since the checkpoint last moved on
    (an attempt whose line names a newer one than every line before restarts the count, and counts
    itself if it failed) and since the last resubmit with reset_failures. The batch script counts the
    same lines with awk over the raw ledger."""
    n, best = 0, 0
    for r in records:
        if is_event(r):
            if r.get("reset_failures") is True:
                n = 0
            continue
        c = r.get("checkpoint")
        if isinstance(c, int) and c > best:
            best, n = c, 0
        if str(r.get("reason", "")).startswith("failed"):
            n += 1
    return n


def record_resubmit(run: RunDir | str | Path, next_attempt: int, reset_failures: bool) -> dict[str, Any]:
    """Append the resubmit record, before sbatch: the new job may fail and count its failures at
    once. The ledger's other writer, the batch shell, is not running (the run's job has ended)."""
    rd = as_rundir(run)
    rec = {"event": RESUBMITTED, "next_attempt": next_attempt, "reset_failures": reset_failures,
           "at": int(time.time())}
    line = json.dumps(rec)
    assert (RESET_MARK in line) == reset_failures and FAILED_MARK not in line
    with open(rd.ledger, "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())
    return rec
