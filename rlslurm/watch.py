"""`rlslurm status --follow`: a run's training steps as they are trained, one line each (the trainer's
own line, rlslurm/step_line.py, from RUN/metrics.jsonl), until no attempt of it lives any more; then
how it ended. It reads the run directory only: it works the same for a SLURM job and a `rlslurm run`,
from any machine that sees the run directory, and a requeued job's next attempt is followed too
(its job stays alive while it waits). Its load on the shared filesystem: metrics.jsonl read from where
it left off every 2 s, the run's status (the listings `rlslurm status` makes) every 10 s.
"""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console

from rlslurm.buffer.rundir import RunDir
from rlslurm.slurm.status import RunStatus, run_status, state_row
from rlslurm.step_line import MetricsTail, step_line

# States of a job that will still run an attempt (pending after a requeue, or running one).
_WAITING = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "RUNNING", "SUSPENDED"}


def over(st: RunStatus) -> bool:
    """Nothing more will be trained without a new submission: finished, or no attempt lives and no job
    of the run is waiting to start one."""
    return st.finished or (not st.attempt_lives and st.slurm.get("state") not in _WAITING)


def follow(run_dir: Path, console: Console, *, recent: int = 5, poll_s: float = 2.0, status_every_s: float = 10.0,
           query_slurm: bool = True) -> RunStatus:
    """Print the last `recent` steps' lines, then each new one, until the run is `over`; then its state.
    Returns the last status read."""
    tail = MetricsTail(RunDir(run_dir).metrics)
    for rec in tail.new()[-recent:]:
        console.print(step_line(rec), markup=False, highlight=False)
    st = run_status(run_dir, query_slurm=query_slurm)
    checked = time.monotonic()
    while not over(st):
        time.sleep(poll_s)
        for rec in tail.new():
            console.print(step_line(rec), markup=False, highlight=False)
        if time.monotonic() - checked >= status_every_s:
            st, checked = run_status(run_dir, query_slurm=query_slurm), time.monotonic()
    for rec in tail.new():  # the last steps, written before the attempt ended
        console.print(step_line(rec), markup=False, highlight=False)
    label, value = state_row(st)
    console.print(f"{label}: {value}", markup=False, highlight=False)
    return st
