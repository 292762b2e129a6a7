"""The rollout side of the weight-update bracket.

An SGLang server blocked in a weight-update broadcast answers neither /health nor /generate
(docs/sglang-behaviour.md, "Health checks during weight updates"), so the supervisor must not
restart it then. The trainer's stage-0 leader marks the bracket with
`control/weight_update.json` (`WeightUpdateRecord` in buffer/control.py, written by
trainer/weights/broadcast.py); `UpdateWatcher` holds
`EngineSupervisor.pause_health_checks()` while that record is present and its `until` has not
passed.

The hold is bounded by `cap_s` (the configured weight-sync timeout plus a margin), measured on
this node's monotonic clock: `until` is the trainer's wall clock, which another node's clock
may disagree with by minutes, and a trainer that hangs without crashing leaves a record saying
"updating" for as long as its `until`. Past the cap the checks resume and that is logged, so a
peer that never answers is found and restarted while the trainer's own timeouts fail the sync.
A new record (the trainer rewrites it for its next try) is honoured again with a fresh cap.

Nodes > 0 do not look on their own (`look=False`, rollout/node.py): a health check that fails outside
a pause asks `covers()`, which reads the record then; an update found that way is held from then on
as if the watcher had seen it (polled every POLL_S until it ends). Only an engine blocked in the
broadcast makes a check fail, so the update is noticed exactly when it matters; between updates such a
node reads nothing, where a look every 10 s was most of a 1,024-GPU job's load on the shared
filesystem (docs/shared-fs-load.md). Node 0 still looks: its router is not restarted inside a pause.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from rlslurm.buffer.atomic import CorruptRecord
from rlslurm.buffer.control import Control, WeightUpdateRecord
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
# Each poll lists control/ and opens the record (~4 metadata operations on the shared run directory):
# 20 polls a second per rollout node were most of a 1,024-GPU job's load (docs/shared-fs-load.md).
# Between updates only node 0 polls (`look`); during a hold, this often to see the update end.
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
                 poll_s: float = POLL_S, look: bool = True):
        if cap_s <= 0:
            raise ValueError(f"cap_s must be > 0, got {cap_s}")
        self.control, self.supervisor, self.cap_s, self.poll_s = control, supervisor, cap_s, poll_s
        self.look = look  # False: read the record only when covers() asks (a failed health check)
        self.held = 0
        self.capped = 0
        self._given_up: tuple | None = None  # the record whose cap ran out: not held again
        self._seen: tuple[tuple | None, float] = (None, 0.0)  # a record covers() saw first, and when
        self._found: WeightUpdateRecord | None = None  # what covers() found: the watcher holds it
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weight-update-watcher", daemon=True)

    def start(self) -> "UpdateWatcher":
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
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
        if now - self._seen[1] > self.cap_s:
            return False
        # hold it from now on: the next checks are not run (and the record not read) per engine
        self._found = rec
        self._wake.set()
        return True

    def _run(self) -> None:
        while not self._stop.is_set():  # (a hold's end clears _wake, perhaps just after close() set it)
            self._wake.wait(self.poll_s if self.look else None)
            if self._stop.is_set():
                return
            self._wake.clear()
            found, self._found = self._found, None
            try:
                rec = found if found is not None else active_update(self.control) if self.look else None
                if rec is not None and _key(rec) != self._given_up:
                    self._hold(rec)
            except Exception:  # the watcher must outlive a bad read; the supervisor keeps checking
                log.exception("weight-update watcher: round failed")

    def _hold(self, rec: WeightUpdateRecord) -> None:
        key, t0 = _key(rec), time.monotonic()
        # the cap counts from this node's first sight of the record (covers() may have seen it first)
        deadline = (self._seen[1] if self._seen[0] == key else t0) + self.cap_s
        # The trainer is already sending: waiting for a restart in progress (~60 s on CPU) would
        # only delay noticing that this update ended; the engine being restarted is not in the
        # update (engines.json lists it unhealthy).
        with self.supervisor.pause_health_checks(wait_restarts=False):
            self.held += 1
            self._forget_found()  # covers() of checks that failed before the pause began: this hold
            try:
                self._poll_until_over(rec, key, deadline, t0)
            finally:
                self._forget_found()  # a check that failed as it ended: the next failure asks again

    def _forget_found(self) -> None:
        self._wake.clear()
        self._found = None

    def _poll_until_over(self, rec: WeightUpdateRecord, key: tuple, deadline: float, t0: float) -> None:
        while not self._stop.wait(max(0.0, min(self.poll_s, deadline - time.monotonic()))):
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
