"""The rollout side of the weight-update bracket.

An SGLang server blocked in a weight-update broadcast answers neither /health nor /generate
(docs/sglang-behaviour.md, "Health checks during weight updates"), so the supervisor must not
restart it then. The trainer's stage-0 leader marks the bracket with
`control/weight_update.json` (`WeightUpdateRecord` in buffer/control.py, written by
trainer/weight_sync.py); `UpdateWatcher` holds
`EngineSupervisor.pause_health_checks()` while that record is present and its `until` has not
passed.

The hold is bounded by `cap_s` (the configured weight-sync timeout plus a margin), measured on
this node's monotonic clock: `until` is the trainer's wall clock, which another node's clock
may disagree with by minutes, and a trainer that hangs without crashing leaves a record saying
"updating" for as long as its `until`. Past the cap the checks resume and that is logged, so a
peer that never answers is found and restarted while the trainer's own timeouts fail the sync.
A new record (the trainer rewrites it for its next try) is honoured again with a fresh cap.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from rlslurm.buffer.control import Control, WeightUpdateRecord
from rlslurm.buffer.atomic import CorruptRecord
from rlslurm.errors import DataError

if TYPE_CHECKING:
    from rlslurm.engines.supervisor import EngineSupervisor

log = logging.getLogger(__name__)

# How long past --weight-sync-timeout-s one update record may hold the health checks: the
# bracket's HTTP calls and a bucket's broadcast are each bounded by the timeout, and the
# teardown of a failed try by CLEANUP_TIMEOUT_S (10 s) per call.
PAUSE_MARGIN_S = 30.0
# The poll only spares the engines health checks during an update: a check that fails before the
# watcher noticed the record is excused by `covers()`, which the supervisor asks then (read fresh).
# Each poll lists control/ and opens the record (~4 metadata operations on the shared run directory,
# per rollout node): 20 polls a second were most of a 1,024-GPU job's load (docs/shared-fs-load.md).
POLL_S = 10.0


def active_update(control: Control, *, now: float | None = None) -> WeightUpdateRecord | None:
    """The update record while a trainer writes weights into the engines: present and not past
    its `until`; else None."""
    try:
        rec = control.weight_update()
    except (DataError, CorruptRecord) as e:  # a foreign or damaged file must not stop health checking
        log.warning("ignoring %s", e)
        return None
    if rec is None:
        return None
    return rec if rec.until > (time.time() if now is None else now) else None


def update_in_progress(control: Control, *, now: float | None = None) -> bool:
    return active_update(control, now=now) is not None


def _key(rec: WeightUpdateRecord) -> tuple:
    return rec.version, rec.until, rec.pid


class UpdateWatcher:
    """A thread that holds `supervisor.pause_health_checks()` while an update record is active,
    for at most `cap_s` per record. `held` / `capped` count the records honoured / cut short."""

    def __init__(self, control: Control, supervisor: "EngineSupervisor", *, cap_s: float,
                 poll_s: float = POLL_S):
        if cap_s <= 0:
            raise ValueError(f"cap_s must be > 0, got {cap_s}")
        self.control, self.supervisor, self.cap_s, self.poll_s = control, supervisor, cap_s, poll_s
        self.held = 0
        self.capped = 0
        self._given_up: tuple | None = None  # the record whose cap ran out: not held again
        self._seen: tuple[tuple | None, float] = (None, 0.0)  # a record covers() saw first, and when
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weight-update-watcher", daemon=True)

    def start(self) -> "UpdateWatcher":
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def covers(self) -> bool:
        """Asked by the supervisor when a health check failed outside a pause: is an update on now
        (the record read fresh)? Then the failure says nothing. A record is excused for at most cap_s
        from this node's first sight of it, as the watcher holds one."""
        rec = active_update(self.control)
        if rec is None or _key(rec) == self._given_up:
            return False
        key, now = _key(rec), time.monotonic()
        if self._seen[0] != key:
            self._seen = (key, now)
        return now - self._seen[1] <= self.cap_s

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                rec = active_update(self.control)
                if rec is not None and _key(rec) != self._given_up:
                    self._hold(rec)
            except Exception:  # the watcher must outlive a bad read; the supervisor keeps checking
                log.exception("weight-update watcher: round failed")

    def _hold(self, rec: WeightUpdateRecord) -> None:
        key, t0 = _key(rec), time.monotonic()
        deadline = t0 + self.cap_s
        # The trainer is already sending: waiting for a restart in progress (~60 s on CPU) would
        # only delay noticing that this update ended; the engine being restarted is not in the
        # update (engines.json lists it unhealthy).
        with self.supervisor.pause_health_checks(wait_restarts=False):
            self.held += 1
            while not self._stop.wait(self.poll_s):
                cur = active_update(self.control)
                if cur is None:
                    log.info("weight update v%s: engine health checks were paused for %.2f s",
                             rec.version, time.monotonic() - t0)
                    return
                if _key(cur) != key:  # the trainer's next try: it is alive, honour it afresh
                    rec, key, deadline = cur, _key(cur), time.monotonic() + self.cap_s
                if time.monotonic() > deadline:
                    self._give_up(rec, key)
                    return

    def _give_up(self, rec: WeightUpdateRecord, key: tuple) -> None:
        self._given_up = key
        self.capped += 1
        log.warning("weight update v%s (trainer pid %s) still marked in progress after %.0f s, the cap "
                    "(--weight-sync-timeout-s + margin): resuming engine health checks so that a peer that "
                    "never answers is restarted", rec.version, rec.pid, self.cap_s)
