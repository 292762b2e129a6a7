"""Getting each trained weight version to this attempt's engines: `WeightDelivery`, the trainer's one
handle on weight sync. Its state is rank 0's decisions (what is pending, what is due while the loop
waits: `due`); its actions are collective, called on every rank by the trainer loop (trainer/main.py)
and its turns (trainer/turns.py): `publish`, `defer`, `publish_or_defer`, `wait_for_engines`, `probe`.
What it publishes with is built by factory.py from the run's plan (rlslurm/settings/weight_plan.py).

A version is published as soon as it is trained, unless this attempt's engines are not up yet (a
requeued job trains the rollouts already in the buffer while its engines start): then it is
*pending* here and goes out once they are. An engine restarted mid-run comes back with the
checkpoint's weights and is kept out of the router until it serves the published version
(`awaiting_weights` in control/engines.json); it is given that version again, once per restart.

Every publish is recorded as a `Delivered` (record.py): the transport that delivered the version and
whether the disk fallback did. They go into metrics.jsonl (`metrics`), and by the publishers into
control/weight_version.json, which `rlslurm status` and `rlslurm run` show. A version that reached no engine (the
fallback found none answering) is not delivered: it is pending again until the engines are up.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist

from rlslurm.buffer.control import Control, Listing
from rlslurm.settings.weight_plan import WeightSyncPlan
from rlslurm.trainer.weights.record import Delivered

log = logging.getLogger("rlslurm.trainer.delivery")


@dataclass(frozen=True)
class Publish:
    """Publish `version` now; `again`: to engines restarted since it was first published."""

    version: int
    again: bool = False


class WeightDelivery:
    """`no_engines`: the run starts none (a replay, --debug-train-only). `note`: told what the trainer
    does now, for its phase record; `ending`: rank 0's "the attempt is ending" (a TERM, a stop or
    preempt request). `start` gives it the publisher and the model once they are built."""

    def __init__(self, control: Control, plan: WeightSyncPlan, *, rank: int = 0, no_engines: bool = False,
                 note: Callable[[str], None] = lambda text: None, ending: Callable[[], bool] = lambda: False):
        self.control, self.plan, self.rank = control, plan, rank
        self.needs_engines = not plan.by_disk and not no_engines  # False: nobody to wait for or publish to again
        self.sync_timeout_s = plan.timeout_s
        self.note, self.ending = note, ending
        self.publisher: Any = None          # factory.py's, once the model is built (`start`)
        self.st: Any = None                 # the trainer's state (trainer/setup.py): its model
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
            out["weight_sync/version"] = self.last.version
            out["weight_sync/transport"] = self.last.transport
        if self._unlogged:
            out["weight_sync/deliveries"] = [d.as_dict() for d in self._unlogged]
            self._unlogged = []
        return out

    def undelivered(self, version: int) -> None:
        """`version` reached no engine: pending again until every engine is up."""
        self.pending, self.engines_up, self.started = version, False, time.monotonic()
        log.warning("weight version %d reached no engine: it is published again once the engines are up", version)

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
            if not self.engines_ready():
                return None
            # it goes to every healthy engine, restarted ones awaiting weights too: none of them gets it
            # again below (a colocated engine killed in the turn got v2 twice on a GPU, 0.03 s apart:
            # bench/results/colocate-faults-h100x4.md)
            self._republished.update((e.url, e.restarts) for e in self.control.engines(seen)
                                     if e.healthy and e.awaiting_weights)
            return Publish(self.pending)
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

    # ------------------------------------------------------------------ actions (collective)

    def start(self, publisher: Any, st: Any) -> None:
        self.publisher, self.st = publisher, st

    def publish(self, version: int, *, in_turn: bool = False) -> None:
        """`in_turn`: inside --colocate's phases, where the engines' KV cache is released: they stay
        paused after the update and the probe waits until the colocation has resumed them."""
        if hasattr(self.publisher, "leave_paused"):  # an engine transport's; every publish comes through here
            self.publisher.leave_paused = in_turn
        self.note(f"publishing weights v{version}")
        d = self.publisher.publish(self.st.actor.model, version)
        self.record(d)
        if d.reached_none:  # the fallback found no engine answering: not delivered, pending again
            self.undelivered(version)
            return
        self.delivered(version)
        if self.plan.verify and not in_turn:
            self.probe(version)

    def defer(self, version: int) -> None:
        """Publish once this attempt's engines are up (`due`); at once where none is waited for."""
        if not self.needs_engines:
            self.publish(version)
            return
        self.pending = version
        log.info("weight version %d will be published once this attempt's engines are up", version)

    def publish_or_defer(self, version: int) -> None:
        """Publish now if the engines are up, else keep the version for the loop's poll (`due`)."""
        if not self.needs_engines:
            self.publish(version)
            return
        # once the job ends (a TERM, a stop or preempt request) no publish begins: the engines are going,
        # and the checkpoint carries this version to the next attempt
        ready = [self.engines_ready() and not self.ending() if self.rank == 0 else None]
        dist.broadcast_object_list(ready, src=0)
        if ready[0]:
            self.publish(version)
        else:
            self.defer(version)

    def wait_for_engines(self) -> None:
        """Rank 0 waits (bounded by --weight-sync-timeout-s) until this attempt's engines are registered
        and healthy; the batch script removed the previous attempt's records. On timeout the publish
        goes ahead and its own failure handling (disk fallback) applies."""
        if not self.needs_engines:
            return
        self.note("waiting for the engines")
        if self.rank == 0:
            deadline = time.monotonic() + self.sync_timeout_s
            while time.monotonic() < deadline:
                if self.all_engines_healthy():
                    break
                time.sleep(1.0)
            else:
                log.warning("no healthy engines after %.0fs; publishing anyway", self.sync_timeout_s)
        dist.barrier()

    def probe(self, version: int) -> None:
        """--verify-weight-sync: the trainer's greedy output against every engine's (probe.py)."""
        from rlslurm.trainer.weights.probe import probe_engines

        probe_engines(self.st, self.control, version, rank=self.rank, ending=self.ending)

    def close(self) -> None:
        close = getattr(self.publisher, "close", None)
        if close is not None:
            close()
