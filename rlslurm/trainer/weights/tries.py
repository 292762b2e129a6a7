"""The tries around every engine transport: `SyncPublisher.publish(model, version)`, on every trainer
rank, with the transport (broadcast.py or ipc.py) it is built with:

    coordinator      control/weight_update.json (Control.mark_weight_update: "updating" until ...)
    transport        join: reach the engines (a group per stage, or the readers of each GPU's buffer)
    coordinator      POST /pause_generation, /begin_weight_update to every engine
    transport        transfer: every bucket of the export
    coordinator      /end_weight_update, /update_weight_version, /continue_generation (not inside
                     --colocate's turn: `leave_paused`); Control.set_weight_version(version, transport)

Ranks agree on success after each phase (an all-reduce over the default group), so a failure on one
rank is seen by every rank at the same point. Every HTTP call and collective is bounded by
`timeout_s`. A failed try tears the transport down and closes the engines' update session; the next
try rebuilds it without the engines that did not answer (their supervisors check them once the
bracket is closed, and restart a wedged one). After `attempts` failed tries the version is published
by the fallback (--weight-sync-fallback disk: `DiskPublisher` writes weights/v<N>/, the coordinator
loads it into every engine that answers), or with no fallback `WeightSyncError` is raised: the
attempt fails and SLURM requeues it. What a retry cannot heal ends the attempt at once as a user error
(`WeightSyncSetupError`). A stop, preempt or TERM interrupts a sync in flight (`SyncInterrupted`).
Every publish returns a `Delivered` (record.py) naming the transport that delivered it. It never
waits without a bound.

The rollout side must not restart an engine that is blocked in a join or a broadcast (it answers
neither /health nor /generate): every rollout node's `UpdateWatcher` (engines/update_watch.py) holds
`EngineSupervisor.pause_health_checks()` while weight_update.json is present and fresh, for at most
the timeout plus a margin.

Composed, not inherited: a transport supplies its roles, sender, join and transfer (base.py
`Transport`); this class owns the order and the failure handling, once for both.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from rlslurm.buffer.control import Control
from rlslurm.engines.fanout import Cancelled, Engines, HttpLoop, Unanswered, engine_targets, release
from rlslurm.trainer.collectives import collective_device
from rlslurm.trainer.weights.base import (
    Roles,
    SyncInterrupted,
    SyncOptions,
    Transport,
    WeightSyncError,
    WeightSyncSetupError,
    setup_refusal,
)
from rlslurm.trainer.weights.group import NoEngines, SyncCancelled
from rlslurm.trainer.weights.record import ERROR_CHARS, Delivered

log = logging.getLogger("rlslurm.trainer.weight_sync")


class SyncPublisher:
    """`WeightPublisher` to the engines' memory by `transport` (see the module docstring).

    `fallback`: the publisher used for a version whose transport failed `opts.attempts` times
    (a `DiskPublisher`; its weights are then loaded into the engines from RUN/weights/v<N>/), or
    None to raise `WeightSyncError` instead. `ending`: true once the job ends (a stop, a preempt, a
    TERM; checked by the leaders while they wait): the sync in flight is given up. `note`: told what
    the publish is doing ("weight sync v3 (nccl): try 2/2"), for the trainer's phase record."""

    def __init__(self, transport: Transport, mc: Any, control: Control, *, api_key: str | None, opts: SyncOptions,
                 fallback: Any | None = None, weights_dir: Path | None = None, attempt: int = 0,
                 export: Callable[[Any, torch.nn.Module, torch.dtype | None], Iterator[tuple[str, torch.Tensor]]]
                 | None = None, ending: Callable[[], bool] | None = None,
                 note: Callable[[str], None] | None = None):
        self.mc, self.control, self.api_key, self.opts = mc, control, api_key, opts
        self.via, self.fallback, self.attempt = transport, fallback, attempt
        self.weights_dir = Path(weights_dir) if weights_dir is not None else control.run.weights_dir
        self._export = export
        self.ending, self._note = ending, note
        self._roles: Roles | None = None
        self.sender: Any = None                 # this rank's sender, the transport's
        self.deliveries: list[Delivered] = []   # one per publish (every rank's view of the agreed outcome)
        self.fallbacks = 0                       # versions the disk fallback delivered in this attempt
        self._interrupted = False                # this rank gave up a wait: the job is ending
        self._no_engines = False                 # this rank found no engine to send to
        # --colocate's turn (trainer/colocate.py): the engines' KV cache is still released during the
        # publish, so they must stay paused after it; the colocation continues them once it is back
        # (a scheduler continued without it crashes at its next prefill: docs/colocate.md)
        self.leave_paused = False

    def transport(self, r: Roles) -> str:
        """What delivers a version when the tries succeed (the transport record's name)."""
        return self.via.name(self.opts, r)

    # -- collective helpers ----------------------------------------------------------------
    def agree(self, ok: bool) -> bool:
        """All ranks: True iff every rank's `ok` is True (also a barrier between phases)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return ok
        t = torch.tensor([1 if ok else 0], dtype=torch.int32, device=collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def gather(self, obj: Any) -> list[Any]:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return [obj]
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    def stream(self, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """The HF-named tensors every transport sends: FP8 blocks or INT4 groups where the engines
        serve such a checkpoint (`opts.quantizer`, rlslurm/settings/weight_plan.py `fp8_block`, `int4_group`)."""
        if self._export is not None:
            stream = self._export(self.mc, model, self.opts.dtype)
        else:
            from rlslurm.convert import mcore_to_hf

            stream = mcore_to_hf(self.mc, model, dtype=self.opts.dtype)
        return self.opts.quantizer.quantize(stream) if self.opts.quantizer is not None else stream

    def step(self, what: str, fn: Callable[[], Any], errors: list[str]) -> bool:
        try:
            fn()
            return True
        except WeightSyncSetupError:
            raise  # collective: raised by every rank that sees it, before any engine is asked to join
        except NoEngines as e:
            self._no_engines = True
            errors.append(f"{what}: {e}")
            log.warning("weight sync: %s: %s", what, e)
            return False
        except (Cancelled, SyncCancelled) as e:
            self._interrupted = True
            errors.append(f"{what}: {e}")
            log.warning("weight sync: %s given up: the job is ending", what)
            return False
        except Exception as e:  # every failure of a step means: tear down, retry or fall back
            if isinstance(e, Unanswered) and self.sender is not None and getattr(self.sender, "engines", None):
                hung = set(e.urls)
                self.sender.unanswered |= {t.identity for t in self.sender.engines.targets if t.url in hung}
            errors.append(f"{what}: {e}")
            log.warning("weight sync: %s failed: %s", what, e)
            return False

    def _say(self, text: str) -> None:
        if self._note is not None:
            self._note(text)

    # -- publish ---------------------------------------------------------------------------
    def publish(self, model: torch.nn.Module, version: int) -> Delivered:
        r = self._roles = self._roles or self.via.roles()
        if self.sender is None:
            self.sender = self.via.new_sender(self, r)
        transport = self.transport(r)
        t0 = time.monotonic()
        errors: list[str] = []
        for i in range(1, self.opts.attempts + 1):
            self._say(f"weight sync v{version} ({transport}): try {i}/{self.opts.attempts}")
            t_try = time.monotonic()
            if self._attempt(model, version, r, errors):
                if r.coordinator:
                    self.control.set_weight_version(version, transport=transport, fallbacks=self.fallbacks)
                    self.control.clear_weight_update()
                    log.info("weights v%d %s to %d engine(s) over %s in %.2f s (%d bytes, %d buckets)", version,
                             self.via.sent,
                             len(self.sender.engines.targets) if self.sender and self.sender.engines else 0,
                             transport, time.monotonic() - t0, self.sender.last.bytes if self.sender else 0,
                             self.sender.last.buckets if self.sender else 0)
                return self._delivered(Delivered(version, transport, tries=i, seconds=time.monotonic() - t0))
            if r.coordinator:
                self._end_sessions()
            if self.sender is not None:
                self.sender.teardown()
            nobody = self._after_failed_try(version, r, errors)
            if r.coordinator:  # the bound each try keeps is checked against this line (tests/e2e)
                log.warning("weight sync v%d: try %d/%d failed after %.1f s (timeout %g s)", version, i,
                            self.opts.attempts, time.monotonic() - t_try, self.opts.timeout_s)
            if nobody:  # every engine is restarting or gone: the version waits for them, no fallback
                if r.coordinator:
                    log.warning("weight sync v%d: no engine to send it to; it goes out once they are up", version)
                return self._delivered(Delivered(version, transport, tries=i, seconds=time.monotonic() - t0,
                                                 engines=0, errors=tuple(e[:ERROR_CHARS] for e in errors)))
        return self._fail(model, version, r, errors, t0)

    def _end_sessions(self) -> None:
        """After a failed try: close the engines' weight-update session (SGLang 0.5.23 refuses a second
        /begin_weight_update while one is open: every retry failed on it), leaving them paused for the
        next try; not on engines that did not answer (each would cost the cleanup timeout)."""
        s = self.sender
        engines = getattr(s, "engines", None)
        if engines is None:
            return
        live = [t for t in engines.targets if t.identity not in s.unanswered]
        if live:
            ending = Engines(engines.loop, live, self.api_key)
            ending.best_effort("end_weight_update")
            ending.close()

    def _delivered(self, d: Delivered) -> Delivered:
        self.deliveries.append(d)
        return d

    def _after_failed_try(self, version: int, r: Roles, errors: list[str]) -> bool:
        """Collective, after a failed try: what no retry heals ends the sync here on every rank (a group
        NCCL refused: `WeightSyncSetupError`; the job ending: `SyncInterrupted`). The bracket is closed
        until the next try, so that the rollout nodes' health checks find a wedged engine. True: there
        was no engine to send to (`NoEngines`)."""
        refused = setup_refusal(errors)
        if refused is not None and self.sender is not None:
            refused += self.via.refusal_detail(self, r)
        ending = self._interrupted or (r.coordinator and self.ending is not None and self.ending())
        verdicts = self.gather((refused, ending, self._no_engines))
        self._interrupted = self._no_engines = False
        refused = next((v[0] for v in verdicts if v[0]), None)
        if r.coordinator:  # closed: the rollout nodes' health checks run until the next try
            self.control.clear_weight_update()
        if refused is not None:  # the attempt ends: nothing to release the engines for (they end with it)
            raise WeightSyncSetupError(f"weight sync v{version}: the group was refused, which no retry, fallback "
                                       f"or requeue heals: {refused}")
        if any(v[1] for v in verdicts):
            raise SyncInterrupted(f"weight sync v{version}: given up, the job is ending")
        return any(v[2] for v in verdicts)

    def _attempt(self, model: torch.nn.Module, version: int, r: Roles, errors: list[str]) -> bool:
        o, s = self.opts, self.sender
        ok = True
        if r.coordinator:
            # Before any stage joins: an engine blocked joining a group answers /health no more than
            # one blocked in a broadcast, and the rollout nodes must not restart it for that.
            ok = self.step("marking the update", lambda: self.control.mark_weight_update(
                version, o.timeout_s * (r.stages + 5)), errors)
        ok = self.agree(ok)
        ok = self.via.join(self, r, ok, errors)
        if ok and r.coordinator:
            assert s is not None

            def prologue() -> None:
                assert s.engines is not None
                s.engines.call("pause_generation", mode=o.pause_mode, timeout=o.timeout_s)
                s.engines.call("begin_weight_update", timeout=o.timeout_s)
            ok = self.step("pause + begin_weight_update", prologue, errors)
        ok = self.agree(ok)
        ok = self.via.transfer(self, model, r, ok, errors)
        if ok and r.coordinator:
            assert s is not None and s.engines is not None

            def epilogue() -> None:
                assert s.engines is not None
                s.engines.call("end_weight_update", timeout=o.timeout_s)
                s.engines.call("update_weight_version", new_version=str(version), timeout=o.timeout_s)
                if not self.leave_paused:
                    s.engines.call("continue_generation", timeout=o.timeout_s)
            ok = self.step("end_weight_update + version + continue", epilogue, errors)
        return self.agree(ok)

    def _fail(self, model: torch.nn.Module, version: int, r: Roles, errors: list[str], t0: float) -> Delivered:
        summary = "; ".join(errors) or "another rank failed"
        if self.fallback is None:
            if r.coordinator:
                self._release_engines(None, version)
            raise WeightSyncError(f"weight sync of version {version} failed {self.opts.attempts} time(s) within "
                                  f"{time.monotonic() - t0:.1f} s ({summary}); --weight-sync-fallback off: the "
                                  "attempt fails and the job is requeued")
        if r.coordinator:
            log.error("WEIGHT SYNC FALLBACK: %s of version %d failed %d time(s) in %.1f s (%s); publishing it to "
                      "disk (%s) instead", self.transport(r), version, self.opts.attempts, time.monotonic() - t0,
                      summary, self.weights_dir)
        self._say(f"weight sync v{version}: disk fallback")
        self.fallback.publish(model, version, record=False)  # collective, like ours
        loaded = self._release_engines(self.weights_dir / f"v{version}", version) if r.coordinator else []
        reached = [len(loaded)] if r.coordinator else [0]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(reached, src=0)
        if reached[0]:
            self.fallbacks += 1
        if r.coordinator:
            if loaded:
                self.control.set_weight_version(version, transport="disk", fallbacks=self.fallbacks,
                                                last_fallback=f"v{version}: {summary}")
            log.warning("weight sync v%d: disk fallback %s in %.1f s, loaded by %s", version,
                        "done" if loaded else "reached no engine", time.monotonic() - t0, loaded)
        return self._delivered(Delivered(version, "disk", fallback=True, tries=self.opts.attempts,
                                         seconds=time.monotonic() - t0, engines=reached[0],
                                         errors=tuple(e[:ERROR_CHARS] for e in errors)))

    def _release_engines(self, path: Path | None, version: int) -> list[str]:
        """After a failed broadcast: `fanout.release` on the engines of engines.json, then close
        the update bracket (a supervisor may restart an engine that did not answer)."""
        targets = engine_targets(self.control.engines())
        loaded: list[str] = []
        if targets:
            own = self.sender._loop if self.sender is not None else None
            loop = own or HttpLoop()
            loaded = release(loop, targets, self.api_key, path=path, version=version, timeout_s=self.opts.timeout_s)
            if loop is not own:
                loop.close()
        self.control.clear_weight_update()
        return loaded

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None
