"""--colocate: an engine that dies inside the trainer's turn is restarted only after the turn.

The trainer and the engines take turns on the same GPUs (trainer/colocate.py, docs/colocate.md).
From the engines' release to their last resume the trainer's tensors are on the GPU; an engine
started then (SGLang allocates its weights and a KV cache of --mem-fraction-static of the GPU) OOMs,
burning its restart budget, or makes the trainer OOM. Trainer rank 0 keeps control/colocate_turn.json
for exactly that window (renewed while it lasts); `TurnHold` is the engine supervisor's question
"may a restart begin now?" (engines/supervisor.py `hold_restart`), asked only when an engine has to
be restarted, so it costs the shared filesystem nothing in steady state.

A turn record is honoured while its `until` (the trainer's clock) has not passed and for at most
`cap_s` on this node's clock per record (its renewals are new records): a trainer that died inside
its turn leaves the record behind, and the engine must not wait for it forever.
"""

from __future__ import annotations

import logging
import time

from rlslurm.buffer.atomic import CorruptRecord
from rlslurm.buffer.control import Control
from rlslurm.errors import DataError

log = logging.getLogger(__name__)

POLL_S = 1.0  # how often a held restart asks again (only while one waits)


class TurnHold:
    """Callable: why a restart must wait now (the trainer's turn), or None."""

    def __init__(self, control: Control, *, cap_s: float):
        self.control, self.cap_s = control, cap_s
        self._key: tuple | None = None
        self._first = 0.0

    def __call__(self) -> str | None:
        try:
            rec = self.control.turn()
        except (DataError, CorruptRecord) as e:  # a damaged record must not hold restarts
            log.warning("ignoring %s", e)
            return None
        now = time.time()
        if rec is None or rec.until <= now:
            return None
        key = (rec.version, rec.until, rec.pid)
        if key != self._key:
            self._key, self._first = key, time.monotonic()
        if time.monotonic() - self._first > self.cap_s:
            return None
        return f"the trainer's turn for v{rec.version} holds the GPUs (for {now - rec.since:.1f} s)"
