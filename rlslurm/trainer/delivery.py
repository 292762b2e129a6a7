"""Getting each trained weight version to this attempt's engines: rank 0's decisions, which the
trainer loop (trainer/main.py) makes collective.

A version is published as soon as it is trained, unless this attempt's engines are not up yet (a
requeued job trains the rollouts already in the buffer while its engines start): then it is
*pending* here and goes out once they are. An engine restarted mid-run comes back with the
checkpoint's weights and is kept out of the router until it serves the published version
(`awaiting_weights` in control/engines.json); it is given that version again, once per restart.

Every publish is recorded as a `Delivered`: the transport that delivered the version and whether
the disk fallback did (issue 30: the fallback had delivered every version of the GPU tier while the
tests believed NCCL did). The trainer writes them into metrics.jsonl and control/weight_version.json,
which `rlslurm status` and `rlslurm run` show. A version that reached no engine (the fallback found
none answering) is not delivered: it is pending again until the engines are up.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

from rlslurm.buffer.control import Control, Listing

log = logging.getLogger("rlslurm.trainer.delivery")


@dataclass(frozen=True)
class Publish:
    """Publish `version` now; `again`: to engines restarted since it was first published."""

    version: int
    again: bool = False


# What can deliver a version: a broadcast group's backend, CUDA IPC (--colocate on GPUs) or its CPU
# twin memfd, HF files on disk (--weight-sync disk, or the fallback), or nothing (no engine listens).
TRANSPORTS = ("nccl", "gloo", "cuda-ipc", "memfd", "disk", "none")


ERROR_CHARS = 300


@dataclass(frozen=True)
class Delivered:
    """How one publish went: `transport` delivered `version` (the disk `fallback` after the transport's
    tries failed); `engines`: how many engines took it (None: not counted, e.g. a broadcast reaches
    every engine of its group or fails)."""

    version: int
    transport: str
    fallback: bool = False
    tries: int = 1
    seconds: float = 0.0
    engines: int | None = None
    errors: tuple[str, ...] = ()  # why each failed try failed (each cut to ERROR_CHARS)

    def __post_init__(self) -> None:
        assert self.transport in TRANSPORTS, self.transport

    @property
    def reached_none(self) -> bool:
        return self.engines == 0

    def as_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items() if v not in (None, ())}


class WeightDelivery:
    def __init__(self, control: Control, *, needs_engines: bool, sync_timeout_s: float):
        self.control = control
        self.needs_engines = needs_engines  # False: disk sync or a replay, nobody to wait for
        self.sync_timeout_s = sync_timeout_s
        self.pending: int | None = None     # trained, held until this attempt's engines are up
        self.published: int | None = None   # the last version published in this attempt
        self.engines_up = False
        self.started = time.monotonic()
        # (url, restarts) of restarted engines already given a repeated publish: one each
        self._republished: set[tuple[str, int]] = set()
        self.fallbacks = 0                  # versions the disk fallback delivered in this attempt
        self.last: Delivered | None = None
        self._unlogged: list[Delivered] = []

    def record(self, d: Delivered) -> None:
        """A publish happened (every rank): kept for the next metrics line."""
        self.last = d
        self._unlogged.append(d)
        if d.fallback and not d.reached_none:
            self.fallbacks += 1

    def metrics(self) -> dict:
        """The publishes since the last call, for a rollout's metrics line."""
        out: dict = {"weight_sync/fallbacks": self.fallbacks}
        if self.last is not None:
            out["weight_sync/transport"] = self.last.transport
        if self._unlogged:
            out["weight_sync/deliveries"] = [d.as_dict() for d in self._unlogged]
            self._unlogged = []
        return out

    def undelivered(self, version: int) -> None:
        """`version` reached no engine: pending again until every engine is up."""
        self.pending, self.engines_up, self.started = version, False, time.monotonic()
        log.warning("weight version %d reached no engine: it is published again once the engines are up", version)

    def defer(self, version: int) -> None:
        self.pending = version
        log.info("weight version %d will be published once this attempt's engines are up", version)

    def delivered(self, version: int) -> None:
        self.published, self.pending = version, None

    def engines_ready(self) -> bool:
        """True once this attempt's engines have all been registered and healthy (or the wait for them
        has outlasted --weight-sync-timeout-s and some are); after that, engines that die and restart
        are the publisher's business, not a reason to defer. With none healthy the deferral goes on
        past the timeout: a publish then reaches nobody, and engines that come up later serve the HF
        weights while the driver waits for this version and the trainer for the driver's next rollout
        (bench/bench_chaos.py hit that deadlock after a USR1 requeue, with SGLang CPU start-up 41 s >
        a 20 s sync timeout)."""
        if not self.engines_up:
            timed_out = time.monotonic() - self.started > self.sync_timeout_s
            self.engines_up = self.all_engines_healthy() or \
                (timed_out and any(e.healthy for e in self.control.engines()))
        return self.engines_up

    def all_engines_healthy(self) -> bool:
        engines = self.control.engines()
        return bool(engines) and all(e.healthy for e in engines)

    def due(self, weight_version: int, seen: Listing | None = None) -> Publish | None:
        """What to publish while the trainer waits for a rollout, if anything; `weight_version`: the
        trainer's weights now; `seen`: the poll's listing of control/ (buffer/control.py `Listing`)."""
        if self.pending is not None:
            return Publish(self.pending) if self.engines_ready() else None
        behind = self._awaiting(weight_version, seen)
        if not behind:
            return None
        log.info("engines %s restarted and hold the checkpoint's weights: publishing version %d again",
                 [u for u, _ in behind], self.published)
        self._republished.update(behind)
        return Publish(self.published, again=True)  # type: ignore[arg-type]  # _awaiting: published is set

    def _awaiting(self, weight_version: int, seen: Listing | None = None) -> list[tuple[str, int]]:
        """Restarted engines kept out of the router until they serve the published version, when the
        trainer's weights are that version (with --update-weights-interval > 1 the trainer may be ahead
        of it: then the next scheduled publish reaches them)."""
        if not self.needs_engines or self.published is None or self.published != weight_version:
            return []
        return [(e.url, e.restarts) for e in self.control.engines(seen)
                if e.healthy and e.awaiting_weights and (e.url, e.restarts) not in self._republished]
