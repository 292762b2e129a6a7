"""Keeps one node's SGLang servers alive and registered with the router.

`EngineSupervisor.start()` launches every engine at once (a CPU server takes ~30 s to start,
and they start in parallel), waits for each to be healthy, registers each with the router
(`POST /workers` with the api key, so the router can call the keyed server) and waits until
the router itself reports them healthy. A background thread then watches every engine:

- process gone (kill -9, a crash), looked for every EXIT_POLL_S -> restart at once (--colocate: once
  the trainer's turn is over; noticed within the turn, not a health round later, so that a death
  inside a short turn is held too); but a death no restart can help - CUDA out of memory, or the
  engine's own refusal to start (engines/engine.py `raise_if_final`) - is reported once as what it
  is, with the setting to change, and ends the attempt as a user error (`final`): restarted, the
  same share of the same GPU dies the same way;
- `/health` failing `unhealthy_after` times in a row, checked every `health_interval_s` (hung,
  SIGSTOPped) -> restart.

A restart is: SIGKILL the process tree, DELETE the worker from the router (it would otherwise
only be marked healthy again after the router's own health interval), start on the same
ports, wait healthy, POST it again, wait until the router routes to it; then the restart is
counted and `on_restart` / `on_change` are called. Each restart runs in its own thread, so a
slow restart does not delay detecting a second failure. In-flight requests on a dying engine
are retried by the router on the others (router retries are on).

A restarted server holds the HF checkpoint, not the weights the others serve. With `admit`
given (rollout/node.py: "does it serve the published weight version?"), a restarted engine that
is not admitted yet is healthy but *awaiting weights*: listed for the weight sync (whose next
publish brings it up to date) and not registered with the router, so no sample comes from stale
weights. Each health round registers it once `admit` says yes.

The router is checked too: if its process is gone it is started again on the same address
and every engine is registered with it again (`router_restarts`).

Restarts are bounded: each engine, and the router, may be restarted (each try counts, a failed
one too) at most `max_restarts` times within `restart_window_s` (default 5 within an hour).
Past that - a crash loop, a GPU gone bad, a start that keeps failing - the supervisor stops
restarting anything and sets `failure`; the rollout node's next housekeeping round raises it as
`EngineFailure`, the rollout role exits non-zero, and the attempt ends as a failure: the batch
script requeues the job within --max-failures (fresh processes, perhaps other nodes) instead of
holding the allocation while one engine is retried forever. An occasional crash never runs out.

A server blocked in a weight-update broadcast answers neither `/health` nor `/generate`
(docs/sglang-behaviour.md, "Health checks during weight updates"), so each update is wrapped in
`pause_health_checks()` (by the rollout node's `UpdateWatcher`, engines/update_watch.py, while
the trainer's update record is active): no `/health` check starts inside it and no failed one
counts, and entering it waits for restarts in progress to finish. An engine whose process has
exited is still restarted inside a pause: it is in no broadcast, and marking it unhealthy at once
lets the sync's next try leave it out instead of waiting out the join timeout for it.
`restarts_total` lets the weight sync notice that an engine was restarted (and must re-join the
update group).

With --colocate, an engine that has to be restarted while the trainer holds the GPUs (its turn,
control/colocate_turn.json) is restarted only once the turn is over (`hold_restart`,
engines/turn_watch.py): started inside it, the engine would take memory the trainer is using.

An engine spanning nodes is supervised through its node rank 0 (engines/span.py): `span.prepare`
gives each start of it a new meeting address for its other ranks, and an exit of one of them
(`span.failed_rank`) counts as an exit of the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

from rlslurm.engines.engine import EngineProcess, EngineSpec
from rlslurm.engines.router import RouterError, RouterProcess
from rlslurm.engines.sglang_client import health_sync
from rlslurm.errors import UserError
from rlslurm.gpus import device_uuids

if TYPE_CHECKING:
    from rlslurm.buffer.control import Control, EngineRecord
    from rlslurm.engines.span import SpanLeader

log = logging.getLogger(__name__)

MAX_RESTARTS = 5
# how often the supervisor looks for an engine process that is gone, between health rounds (a waitpid
# each): a --colocate turn lasts seconds, and a death must be seen inside it to be held (turn_watch.py)
EXIT_POLL_S = 0.25
RESTART_WINDOW_S = 3600.0


class EngineFailure(RuntimeError):
    """An engine (or the router) used up its restart budget; the message says which and why."""


class RestartBudget:
    """At most `max_tries` restart tries within any `window_s` seconds."""

    def __init__(self, max_tries: int, window_s: float):
        if max_tries < 1 or window_s <= 0:
            raise ValueError(f"restart budget needs max_tries >= 1 and window_s > 0, got {max_tries}, {window_s}")
        self.max_tries, self.window_s = max_tries, window_s
        self._tries: deque[float] = deque()

    def take(self, now: float | None = None) -> bool:
        """Count one try now; False (nothing counted) when the window already holds `max_tries`."""
        now = time.monotonic() if now is None else now
        while self._tries and now - self._tries[0] >= self.window_s:
            self._tries.popleft()
        if len(self._tries) >= self.max_tries:
            return False
        self._tries.append(now)
        return True

    def describe(self) -> str:
        return f"{self.max_tries} restarts within {self.window_s / 60:g} min"


@dataclass(frozen=True)
class EngineInfo:
    """What the rest of the system needs to know about one engine (control files, metrics)."""

    name: str
    url: str
    host: str
    port: int
    nccl_port: int
    base_gpu_id: int
    tp_size: int             # the whole engine's, over every node it spans
    device: str
    pid: int | None
    healthy: bool
    restarts: int
    worker_id: str | None
    awaiting_weights: bool = False  # healthy, restarted, not routed until it has the published weights
    nnodes: int = 1          # nodes it spans (engines/span.py); its GPUs here: tp_size // nnodes


@dataclass(frozen=True)
class RestartEvent:
    engine: str
    url: str
    reason: str              # "exited (code -9)", "unresponsive (3 failed health checks)", ...
    restarts: int            # this engine's restart count after this restart
    downtime_s: float        # from detection to healthy again (and routed, unless awaiting weights)
    ok: bool                 # False: the restart attempt itself failed (it will be retried)
    error: str | None = None


OnChange = Callable[[list[EngineInfo]], None]
OnRestart = Callable[[RestartEvent], None]
Admit = Callable[[EngineProcess], bool]


class _Slot:
    """Supervisor-side state of one engine."""

    def __init__(self, spec: EngineSpec, budget: RestartBudget):
        self.proc = EngineProcess(spec)
        self.budget = budget
        self.worker_id: str | None = None
        self.healthy = False
        self.restarts = 0
        self.failures = 0
        self.restarting = False
        self.awaiting_weights = False
        # serialises kill/start of this engine between its restart thread and close()
        self.lock = threading.Lock()


class EngineSupervisor:
    def __init__(self, specs: list[EngineSpec], router: RouterProcess, *,
                 health_interval_s: float = 10.0, health_timeout_s: float = 10.0, unhealthy_after: int = 3,
                 start_timeout_s: float = 600.0, register_timeout_s: float = 60.0,
                 restart_backoff_s: float = 5.0,
                 max_restarts: int = MAX_RESTARTS, restart_window_s: float = RESTART_WINDOW_S,
                 on_change: OnChange | None = None, on_restart: OnRestart | None = None,
                 admit: Admit | None = None, span: "SpanLeader | None" = None,
                 hold_restart: Callable[[], str | None] | None = None):
        names = [s.name for s in specs]
        if len(set(names)) != len(names) or len({s.url for s in specs}) != len(specs):
            raise ValueError(f"engine names and urls must be unique: {names}")
        self.router = router
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.unhealthy_after = unhealthy_after
        self.start_timeout_s = start_timeout_s
        self.register_timeout_s = register_timeout_s
        self.restart_backoff_s = restart_backoff_s
        self.on_change = on_change
        self.on_restart = on_restart
        self.admit = admit
        self.span = span
        self.hold_restart = hold_restart  # --colocate: why a restart must wait now (engines/turn_watch.py)
        # is a weight update on now (read fresh)? Asked when a check fails outside a pause: the
        # UpdateWatcher looks only every 10 s, on nodes > 0 not at all (engines/update_watch.py `covers`)
        self.in_update: Callable[[], bool] | None = None
        self._slots = [_Slot(s, RestartBudget(max_restarts, restart_window_s)) for s in specs]
        self._router_budget = RestartBudget(max_restarts, restart_window_s)
        # set once an engine or the router used up its budget: nothing is restarted any more
        self.failure: str | None = None
        # set with `failure` when a restart cannot help (an engine's CUDA OOM, its own refusal to start):
        # the attempt ends as a user error, not requeued (engines/engine.py `raise_if_final`)
        self.final: UserError | None = None
        self._cond = threading.Condition()
        self._paused = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._restart_threads: list[threading.Thread] = []
        self.router_restarts = 0
        self._router_restarting = False  # `recovering`
        self._router_error: str | None = None

    # --- public view ----------------------------------------------------------------------
    @property
    def urls(self) -> list[str]:
        return [s.proc.url for s in self._slots]

    @property
    def restarts_total(self) -> int:
        return sum(s.restarts for s in self._slots)

    def recovering(self) -> bool:
        """A restart of the router or of an engine is under way, with budget left, or a restarted engine
        is up but awaits the published weights (not routed until the trainer's publish again): callers
        that fail meanwhile (the driver's generate retries, rollout/router_context.py) wait for it rather
        than count it against their own tries. With one engine the router has no worker until then:
        the GPU tier's TP2 layout (one engine, killed mid-run) failed its rollout 12 s before the
        engine was routed again."""
        if self.failure is not None:
            return False
        with self._cond:
            return self._router_restarting or any(s.restarting or s.awaiting_weights for s in self._slots)

    def engines(self) -> list[EngineInfo]:
        with self._cond:
            return [self._info(s) for s in self._slots]

    def process(self, name: str) -> EngineProcess:
        for s in self._slots:
            if s.proc.spec.name == name:
                return s.proc
        raise KeyError(name)

    @staticmethod
    def _info(s: _Slot) -> EngineInfo:
        sp = s.proc.spec
        return EngineInfo(name=sp.name, url=sp.url, host=sp.host, port=sp.port, nccl_port=sp.nccl_port,
                          base_gpu_id=sp.base_gpu_id, tp_size=sp.tp_size, device=sp.device, pid=s.proc.pid,
                          healthy=s.healthy and not s.restarting, restarts=s.restarts, worker_id=s.worker_id,
                          awaiting_weights=s.awaiting_weights, nnodes=sp.nnodes)

    def _changed(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change(self.engines())
            except Exception:  # a failing observer must not take the supervisor down
                log.exception("engine supervisor: on_change callback failed")

    # --- start / stop ---------------------------------------------------------------------
    def start(self, *, router_ready: Callable[[], RouterProcess] | None = None) -> None:
        """Start and register every engine, then begin health checking. On failure every
        engine already started is killed and the error (with the server's log tail) raised.

        `router_ready`, if given, is called once the engines are healthy and returns the router to
        register them with (it replaces the one given at construction): the router's start-up, or
        the wait for another node's router, then overlaps the engines' instead of preceding it."""
        try:
            for s in self._slots:
                self._spawn(s)
            deadline = time.monotonic() + self.start_timeout_s
            for s in self._slots:
                took = s.proc.wait_healthy(max(1.0, deadline - time.monotonic()))
                log.info("%s healthy at %s after %.1f s", s.proc.spec.name, s.proc.url, took)
            if router_ready is not None:
                self.router = router_ready()
            for s in self._slots:
                s.worker_id = self.router.add_worker(s.proc.url, s.proc.spec.api_key)
            ids = self.router.wait_workers_healthy(self.urls, self.register_timeout_s)
            with self._cond:
                for s in self._slots:
                    s.worker_id = ids[s.proc.url]
                    s.healthy = True
        except BaseException:
            self._kill_all()
            raise
        self._changed()
        self._thread = threading.Thread(target=self._loop, name="engine-supervisor", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop checking and kill every engine (the router is the caller's)."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=self.health_timeout_s + 5)
        # Killing first makes a restart thread blocked in wait_healthy fail at once; the slot
        # lock guarantees it cannot start a new process after this.
        self._kill_all()
        for t in list(self._restart_threads):
            t.join(timeout=self.register_timeout_s + 10)
        self._kill_all()
        with self._cond:
            for s in self._slots:
                s.healthy = False

    def _kill_all(self) -> None:
        for s in self._slots:
            try:
                with s.lock:
                    s.proc.kill_tree()
            except Exception:
                log.exception("%s: kill_tree failed", s.proc.spec.name)

    def __enter__(self) -> "EngineSupervisor":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- weight-update bracket ------------------------------------------------------------
    @contextmanager
    def pause_health_checks(self, wait_s: float | None = None, *, wait_restarts: bool = True) -> Iterator[None]:
        """No /health check or restart of a live engine starts while inside (an exited one is
        still restarted); entering waits for restarts in progress (TimeoutError after `wait_s`,
        None: no limit) unless `wait_restarts` is False (an update already under way leaves
        engines being restarted out anyway). Nestable, any thread."""
        deadline = None if wait_s is None else time.monotonic() + wait_s
        with self._cond:
            self._paused += 1
            while wait_restarts and any(s.restarting for s in self._slots) and not self._stop.is_set():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    self._paused -= 1
                    busy = [s.proc.spec.name for s in self._slots if s.restarting]
                    raise TimeoutError(f"engines still restarting after {wait_s:g} s: {busy}")
                self._cond.wait(timeout=1.0 if left is None else min(1.0, left))
        try:
            yield
        finally:
            with self._cond:
                self._paused -= 1
                for s in self._slots:
                    s.failures = 0  # checks that failed just before the pause say nothing now
                self._cond.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused > 0

    def raise_if_failed(self) -> None:
        """EngineFailure once an engine or the router used up its restart budget; the UserError of an
        engine that no restart can help."""
        if self.final is not None:
            raise self.final
        if self.failure is not None:
            raise EngineFailure(self.failure)

    def _final(self, s: _Slot, error: UserError) -> None:
        """No restart can help `s` (a CUDA OOM, its own refusal): reported once, nothing restarted again."""
        with self._cond:
            if self.failure is None:
                self.final, self.failure = error, str(error)
            s.restarting = False
            self._cond.notify_all()
        log.error("%s", error)
        self._emit(RestartEvent(s.proc.spec.name, s.proc.url, str(error), s.restarts, 0.0, False, str(error)))

    def _give_up(self, what: str, budget: RestartBudget, reason: str, error: str | None) -> None:
        last = f"; the last try failed: {error.splitlines()[0].rstrip(':')}" if error else ""
        with self._cond:
            if self.failure is None:
                self.failure = (f"{what}: {budget.describe()} ({reason}{last}); not restarted again, "
                                "this attempt ends")
            self._cond.notify_all()
        log.error("%s", self.failure)

    # --- health loop ----------------------------------------------------------------------
    def _loop(self) -> None:
        next_round = time.monotonic() + self.health_interval_s
        while not self._stop.wait(min(EXIT_POLL_S, self.health_interval_s)):
            try:
                if time.monotonic() >= next_round:
                    next_round = time.monotonic() + self.health_interval_s
                    self._tick()
                else:
                    self._tick(exits_only=True)
            except Exception:  # the watchdog must outlive any single bad round
                log.exception("engine supervisor: health round failed")

    def _tick(self, *, exits_only: bool = False) -> None:
        """One health round; `exits_only`: only look for engine processes that are gone (a waitpid
        each), between rounds."""
        if self.failure is not None:  # the node ends this attempt: no more restarts
            return
        if not exits_only and not self.router.is_alive() and not self._paused:
            self._restart_router()
        for s in self._slots:
            with self._cond:
                if s.restarting or self._stop.is_set():
                    continue
                paused = self._paused > 0
            # A pause spares engines that may be blocked in a broadcast; one whose process has
            # exited is in no broadcast, and the sync's next try must not wait for it to join.
            if exits_only:
                reason = None if s.proc.is_alive() else self._exited(s)
            else:
                reason = self._exited(s) if paused else self._check(s)
            if reason is None:
                if s.awaiting_weights and not paused and not exits_only:
                    self._admit_if_current(s)
                continue
            with self._cond:
                if self._stop.is_set():
                    continue
                if self._paused and not reason.startswith("exited"):  # paused since the check: let it be
                    s.failures = 0
                    continue
                s.restarting = True
                s.healthy = False
                s.awaiting_weights = False
            t = threading.Thread(target=self._restart, args=(s, reason), name=f"restart-{s.proc.spec.name}",
                                 daemon=True)
            self._restart_threads = [x for x in self._restart_threads if x.is_alive()] + [t]
            t.start()

    def _spawn(self, s: _Slot) -> None:
        if self.span is not None:
            s.proc.spec = self.span.prepare(s.proc.spec)
        s.proc.start()

    def _exited(self, s: _Slot) -> str | None:
        if not s.proc.is_alive():
            return f"exited (code {s.proc.proc.returncode if s.proc.proc else None})"
        return self.span.failed_rank(s.proc.spec) if self.span is not None else None

    def _check(self, s: _Slot) -> str | None:
        """None if the engine is fine, else why it must be restarted."""
        exited = self._exited(s)
        if exited is not None:
            return exited
        if health_sync(s.proc.url, timeout=self.health_timeout_s):
            s.failures = 0
            return None
        with self._cond:
            if self._paused:  # a pause began during this check: its broadcast may be why it failed
                return None
        if self.in_update is not None and self.in_update():  # an update the watcher has not seen yet
            s.failures = 0
            return None
        with self._cond:
            s.failures += 1
        log.warning("%s: health check failed (%d/%d)", s.proc.spec.name, s.failures, self.unhealthy_after)
        if s.failures >= self.unhealthy_after:
            return f"unresponsive ({s.failures} failed health checks)"
        return None

    def _restart(self, s: _Slot, reason: str) -> None:
        name = s.proc.spec.name
        t0 = time.monotonic()
        self._changed()
        if reason.startswith("exited"):
            try:
                s.proc.raise_if_final("while serving")
            except UserError as e:
                self._final(s, e)
                return
        self._await_turn(s, reason)
        log.warning("%s (%s): %s; restarting", name, s.proc.url, reason)
        error: str | None = None
        while not self._stop.is_set():
            if not s.budget.take():
                self._give_up(f"{name} ({s.proc.url})", s.budget, reason, error)
                self._emit(RestartEvent(name, s.proc.url, reason, s.restarts, time.monotonic() - t0, False,
                                        self.failure))
                break
            try:
                with s.lock:
                    s.proc.kill_tree()
                self._deregister(s)
                with s.lock:
                    if self._stop.is_set():
                        break
                    self._spawn(s)
                s.proc.wait_healthy(self.start_timeout_s)
                held = not self._weights_current(s)
                if not held:
                    self._register(s)
            except UserError as e:  # its restart died of OOM or was refused: the same again would too
                if not self._stop.is_set():
                    self._final(s, e)
                return
            except Exception as e:  # any failure: report, back off, try again (never leave `restarting` set)
                if self._stop.is_set():
                    break
                log.error("%s: restart failed: %s", name, e)
                error = str(e)
                self._emit(RestartEvent(name, s.proc.url, reason, s.restarts, time.monotonic() - t0, False, str(e)))
                self._stop.wait(self.restart_backoff_s)
                continue
            with self._cond:
                s.restarts += 1
                s.failures = 0
                s.healthy = True
                s.restarting = False
                s.awaiting_weights = held
                self._cond.notify_all()
            if held:
                log.warning("%s is back but not at the published weights: not routed until a weight update "
                            "brings it up to date", name)
            self._emit(RestartEvent(name, s.proc.url, reason, s.restarts, time.monotonic() - t0, True))
            self._changed()
            return
        with self._cond:
            s.restarting = False
            self._cond.notify_all()

    def _await_turn(self, s: _Slot, reason: str) -> None:
        """--colocate: while the trainer's turn holds the GPUs, what is left of the dead engine goes at
        once (its processes may still hold GPU memory the trainer needs) and the new one starts only
        after the turn (engines/turn_watch.py). Listed unhealthy meanwhile: the turn leaves it out."""
        why = self.hold_restart() if self.hold_restart is not None else None
        if why is None:
            return
        from rlslurm.engines.turn_watch import POLL_S

        name, t0 = s.proc.spec.name, time.monotonic()
        with s.lock:
            s.proc.kill_tree()
        log.warning("%s (%s): %s; its restart waits: %s", name, s.proc.url, reason, why)
        while why is not None and not self._stop.wait(POLL_S):
            why = self.hold_restart()
        if not self._stop.is_set():
            log.info("%s: the trainer's turn is over; restart held %.1f s", name, time.monotonic() - t0)

    def _restart_router(self) -> None:
        code = self.router.proc.returncode if self.router.proc else None
        if not self._router_budget.take():
            self._give_up(f"router {self.router.url}", self._router_budget, f"exited (code {code})",
                          self._router_error)
            return
        log.warning("router %s exited (code %s); restarting it", self.router.url, code)
        t0 = time.monotonic()
        self._router_restarting = True
        try:
            self.router.start()
            with self._cond:
                live = [s for s in self._slots if not s.restarting and not s.awaiting_weights]
            for s in live:
                s.worker_id = self.router.add_worker(s.proc.url, s.proc.spec.api_key)
            ids = self.router.wait_workers_healthy([s.proc.url for s in live], self.register_timeout_s)
            for s in live:
                s.worker_id = ids[s.proc.url]
        except (RouterError, OSError) as e:
            log.error("router restart failed: %s", e)
            self._router_error = str(e)
            self.router.kill()  # so that the next tick starts it again from scratch
            self._emit(RestartEvent("router", self.router.url, f"exited (code {code})", self.router_restarts,
                                    time.monotonic() - t0, False, str(e)))
            return  # the next tick sees it dead (or unregistered workers) and tries again (still recovering)
        self._router_restarting = False
        self.router_restarts += 1
        self._emit(RestartEvent("router", self.router.url, f"exited (code {code})", self.router_restarts,
                                time.monotonic() - t0, True))
        self._changed()

    def _register(self, s: _Slot) -> None:
        s.worker_id = self.router.add_worker(s.proc.url, s.proc.spec.api_key)
        s.worker_id = self.router.wait_workers_healthy([s.proc.url], self.register_timeout_s)[s.proc.url]

    def _weights_current(self, s: _Slot) -> bool:
        if self.admit is None:
            return True
        try:
            return self.admit(s.proc)
        except Exception as e:  # cannot tell: keep it out of the router and ask again next round
            log.warning("%s: weight version check failed: %s", s.proc.spec.name, e)
            return False

    def _admit_if_current(self, s: _Slot) -> None:
        """Health thread: route an engine awaiting weights once it has them."""
        if not self._weights_current(s):
            return
        try:
            self._register(s)
        except Exception as e:
            log.warning("%s: registering with the router failed (next round tries again): %s", s.proc.spec.name, e)
            return
        with self._cond:
            s.awaiting_weights = False
        log.info("%s has the published weights: routed again", s.proc.spec.name)
        self._changed()

    def _deregister(self, s: _Slot) -> None:
        """Remove every router entry for this url (the old id, and any stale duplicate)."""
        try:
            ids = set(self.router.worker_ids(s.proc.url))
        except RouterError:
            ids = set()
        if s.worker_id:
            ids.add(s.worker_id)
        for wid in ids:
            try:
                self.router.remove_worker(wid)
            except RouterError as e:
                log.warning("%s: removing router worker %s: %s", s.proc.spec.name, wid, e)
        s.worker_id = None

    def _emit(self, ev: RestartEvent) -> None:
        if self.on_restart is not None:
            try:
                self.on_restart(ev)
            except Exception:
                log.exception("engine supervisor: on_restart callback failed")


def engine_records(infos: list[EngineInfo], node: str, control: "Control | None" = None) -> list["EngineRecord"]:
    """This node's engines as control-file records (what the trainer and `rlslurm status` read).
    `control`: where the other ranks of an engine spanning nodes recorded their nodes."""
    from rlslurm.buffer.control import EngineRecord
    from rlslurm.engines.sglang_versions import installed_sglang_version

    version = installed_sglang_version()  # the engines run in this node's Python environment

    def gpu_ids(i: EngineInfo) -> list[int]:
        return [] if i.device == "cpu" else list(range(i.base_gpu_id, i.base_gpu_id + i.tp_size // i.nnodes))

    return [EngineRecord(url=i.url, node=node, sglang_version=version, ranks=i.tp_size, gpu_ids=gpu_ids(i),
                         # the engines inherit this process's CUDA_VISIBLE_DEVICES and device order
                         gpu_uuids=(device_uuids(gpu_ids(i)) or []) if gpu_ids(i) else [],
                         nodes=span_nodes(control, i.name, node, i.nnodes),
                         pid=i.pid, healthy=i.healthy, restarts=i.restarts, awaiting_weights=i.awaiting_weights)
            for i in infos]


def span_nodes(control: "Control | None", engine: str, node: str, nnodes: int) -> list[str]:
    """The node of each node rank of an engine spanning `nnodes` nodes, as its followers recorded them
    ("" for a rank not started yet; an engine is healthy only once every rank is up); [] for one node."""
    if nnodes == 1:
        return []
    recs = [control.span_rank(engine, r) if control is not None else None for r in range(1, nnodes)]
    return [node, *(r.node if r is not None else "" for r in recs)]


def control_publisher(control: "Control", node: str) -> OnChange:
    """An `on_change` that writes this node's engines into RUN/control/engines.json (one node, no merge)."""
    def publish(infos: list[EngineInfo]) -> None:
        control.write_engines(engine_records(infos, node, control))

    return publish
