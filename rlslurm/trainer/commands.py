"""What rank 0 tells every trainer rank to do next (trainer/main.py `_next_command`): it alone reads
the control files and the buffer, and broadcasts one of these (pickled: module-level types)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from rlslurm.trainer.weights.delivery import Publish

# How often the ranks agree on "rollout ready / keep waiting / preempt / stop": the trainer loop's
# poll (trainer/main.py) and --debug-rollout-only's watch (trainer/rollout_only.py) alike.
POLL_S = 1.0


class Next(Enum):
    READY = "ready"      # the next rollout is committed: train it
    WAIT = "wait"        # not yet: poll again
    PREEMPT = "preempt"  # USR1/TERM or a preempt request: checkpoint, acknowledge, exit for requeue
    STOP = "stop"        # a user stop: checkpoint, acknowledge, exit
    END = "end"          # the prompt data ran out before this rollout (control/data_exhausted.json): finish
    # a later attempt started (this one was lost, its processes were not): leave the run alone
    SUPERSEDED = "superseded"


@dataclass(frozen=True)
class Failed:
    """A data error rank 0 found: every rank fails with it, not rank 0 alone."""

    message: str


Command = Next | Publish | Failed
