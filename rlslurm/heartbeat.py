"""Heartbeats (`control/heartbeats/<role>-<rank>.json`): who keeps one, and how often.

Read by the attempt's watchdogs (rlslurm/watchdog.py, the batch script's `silent_role`: a bound of
--distributed-timeout-minutes + 10 min) and by `rlslurm status` (a process is live while its heartbeat
is younger than LIVE_S, 120 s). Each one is a temp file and a rename on the shared run directory
(create, chmod, rename: 3 metadata operations; not fsynced, buffer/control.py), so they are written
per node, at most every HEARTBEAT_S, and at once when the phase `rlslurm status` shows changes
(docs/shared-fs-load.md has the measured load).

Trainer: one rank per node (torchrun's local rank 0; rank 0 is one of them), not every rank. Nothing is
lost for the watchdogs: every trainer rank takes part in the collective of each poll of the loop
(trainer/main.py `_next_command`), so a rank that hangs stalls rank 0 within a poll and rank 0's
heartbeat goes silent with it; a rank inside a collective whose peer died is ended by the
collective's timeout, which the watchdog's bound exceeds. Rollout: one per node (it always was).
"""

from __future__ import annotations

import os
import time
from typing import Callable

# The watchdogs' bound is >= 10 min and `rlslurm status` calls a process gone after 120 s: 30 s is
# four beats within the latter, and a third of the shared filesystem's load of 10 s.
HEARTBEAT_S = 30.0


def keeps_heartbeat(rank: int) -> bool:
    """A trainer rank keeps one: torchrun's local rank 0 of each node; without LOCAL_RANK, rank 0 alone."""
    return int(os.environ.get("LOCAL_RANK", rank)) == 0


class Beat:
    """Calls `write` at most every HEARTBEAT_S (`now=True`: at once), unless `on` is False."""

    def __init__(self, write: Callable[[], object], *, on: bool = True):
        self.on = on
        self._write = write
        self._last = -HEARTBEAT_S

    def __call__(self, *, now: bool = False) -> None:
        t = time.monotonic()
        if self.on and (now or t - self._last >= HEARTBEAT_S):  # an fsynced file per poll is too much for NFS
            self._write()
            self._last = t
