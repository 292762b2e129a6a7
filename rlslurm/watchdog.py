"""The attempt's watchdog: a role whose heartbeat stops for longer than a bound has hung, and the
attempt ends as a failure (requeued within --max-failures) instead of holding the allocation until
its time limit.

Heartbeats: `control/heartbeats/<role>-<rank>.json`, rewritten at most every 10 s (and at a change of
phase) by one trainer rank per node (while it waits for rollouts and once per trained rollout,
rlslurm/trainer/main.py) and by every rollout node (its housekeeping loop, rlslurm/rollout/node.py);
who keeps one and why that is enough: rlslurm/heartbeat.py. Each attempt starts without them (the
batch script and `rlslurm run` remove the previous attempt's), and the first trainer rank and the
first rollout node must beat within the bound of the attempt's start, so a start-up that hangs is
caught too.

The bound must exceed --distributed-timeout-minutes: a rank may legitimately sit in a collective that
long, silent, while rank 0 works alone (a checkpoint on slow storage, a weight-sync prologue); a hang
inside a collective is ended by the collective's own timeout. Default: that timeout + 10 minutes.
The batch script has the same check in shell (rlslurm/templates/hetjob.sbatch.j2, `silent_role`),
on the heartbeat files' modification times; this module is the one `rlslurm run` uses.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from rlslurm.buffer.atomic import listdir_fresh

MARGIN_MINUTES = 10.0
EXPECTED = ("trainer-0", "rollout-0")  # each role's first process beats in every run
# How often the watchdogs look: against a bound of minutes (>= --distributed-timeout-minutes, 10 min +
# that by default), a minute late at most costs little; each look is a metadata operation per heartbeat
# file (the batch script's one stat(1); 128 files at 128 nodes: docs/shared-fs-load.md).
CHECK_EVERY_S = 60.0


def hang_timeout_s(train) -> float:
    """The bound in seconds from a TrainSection (0: the watchdog is off)."""
    if train.hang_timeout_minutes is None:
        return (train.distributed_timeout_minutes + MARGIN_MINUTES) * 60.0
    return train.hang_timeout_minutes * 60.0


def silent_roles(heartbeat_dir: Path, bound_s: float, since: float, now: float | None = None) -> list[str]:
    """Heartbeats (`role-rank`) older than `bound_s`; an expected one that was never written counts from
    `since` (the attempt's start). Files' modification times are the clock, as in the batch script."""
    now = time.time() if now is None else now
    last: dict[str, float] = {name: since for name in EXPECTED}
    for name in listdir_fresh(heartbeat_dir):
        if not name.endswith(".json") or name.startswith("."):
            continue
        try:
            last[name[: -len(".json")]] = os.stat(heartbeat_dir / name).st_mtime
        except FileNotFoundError:
            continue  # replaced between the listing and the stat: it was just written
    return sorted(name for name, t in last.items() if now - t > bound_s)
