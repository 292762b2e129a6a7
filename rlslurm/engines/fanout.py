"""One HTTP call to every engine at once: how the trainer's weight sync talks to the engines.

`engine_targets` turns control/engines.json into the engines a sync writes to; `Engines` runs
one `SGLangClient` method on all of them concurrently on an `HttpLoop` (an asyncio loop in a
daemon thread, so the calling thread can block in a broadcast meanwhile: waiting for one engine
before calling the next deadlocks the group); `refusing` finds the engines where nothing listens;
`release` ends a failed update on every engine that answers. Every call is bounded by the
timeout it is given, cleanup calls by CLEANUP_TIMEOUT_S, and a wait ends early when the `cancel`
the trainer gives says the job is ending (a stop, a preempt, a TERM: no sync runs on for minutes
after Ctrl-C). The broadcast itself (torch.distributed) is trainer/weights/broadcast.py's
and trainer/weights/group.py's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Coroutine, Iterable
from urllib.parse import urlsplit

from rlslurm.buffer.control import EngineRecord
from rlslurm.engines.sglang_client import SGLangClient, SGLangError, SGLangTimeout
from rlslurm.engines.sglang_versions import api_for

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# Cleanup calls on engines that may be hung must not stretch a failure much past its bound.
CLEANUP_TIMEOUT_S = 10.0
REFUSED_TIMEOUT_S = 2.0


# How often a wait looks at its `cancel`: a stop is answered within this.
CANCEL_POLL_S = 0.5


class Unanswered(TimeoutError):
    """Engines that did not answer a call within its bound (their urls)."""

    def __init__(self, what: str, urls: list[str], timeout_s: float):
        self.urls = urls
        super().__init__(f"{what}: {len(urls)} engine(s) did not answer within {timeout_s:g} s ({', '.join(urls)})")


class Cancelled(RuntimeError):
    """A wait given up because the caller's `cancel` said so (the job is ending)."""


@dataclass(frozen=True)
class EngineTarget:
    url: str
    ranks: int           # the engine's TP size: its ranks are rank_offset .. rank_offset+ranks-1
    pid: int | None
    restarts: int
    sglang_version: str | None = None
    # the physical GPU of each of its TP ranks (rlslurm/gpus.py), where the rollout node could tell
    gpus: tuple[str, ...] = ()

    @property
    def identity(self) -> tuple[str, int | None, int]:
        """This process of the engine: a restart is another one."""
        return self.url, self.pid, self.restarts


def engine_targets(records: Iterable[EngineRecord]) -> list[EngineTarget]:
    """The healthy engines of control/engines.json (one being restarted joins the next sync)."""
    return [EngineTarget(url=r.url, ranks=r.ranks or max(1, len(r.gpu_ids)), pid=r.pid, restarts=r.restarts,
                         sglang_version=r.sglang_version, gpus=tuple(r.gpu_uuids))
            for r in records if r.healthy]


async def refusing(urls: list[str]) -> list[str]:
    """The urls where nothing listens (connection refused). A connect that times out says
    nothing (a hung or far engine): the join's own timeout decides about those."""
    async def one(url: str) -> bool:
        u = urlsplit(url)
        try:
            _, w = await asyncio.wait_for(asyncio.open_connection(u.hostname, u.port), REFUSED_TIMEOUT_S)
        except ConnectionRefusedError:
            return True
        except (OSError, asyncio.TimeoutError):
            return False
        w.close()
        return False

    refused = await asyncio.gather(*(one(u) for u in urls))
    return [u for u, r in zip(urls, refused) if r]


def dtype_name(dt: torch.dtype) -> str:
    """A dtype as /update_weights_from_distributed takes it: SGLang does getattr(torch, name)."""
    return str(dt).removeprefix("torch.")


class HttpLoop:
    """An asyncio loop in a daemon thread: HTTP calls to all engines run there concurrently
    while the calling thread blocks in a broadcast."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="weight-sync-http", daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine) -> cf.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


class Engines:
    """HTTP to a fixed set of engines; `call(name, ...)` runs one client method on all of them at
    once and raises the first failure after all have finished or `timeout` passed (`Unanswered`
    names the engines that did not answer), or `Cancelled` as soon as `cancel()` is true."""

    def __init__(self, loop: HttpLoop, targets: list[EngineTarget], api_key: str | None, *,
                 cancel: Callable[[], bool] | None = None):
        self.loop, self.targets, self.api_key, self.cancel = loop, targets, api_key, cancel
        self._clients = [SGLangClient(t.url, api_key, api=api_for(t.sglang_version)) for t in targets]
        self._url_of: dict[cf.Future, str] = {}

    def submit(self, method: str, per_engine: Callable[[int], dict[str, Any]] | None = None,
               **kw: Any) -> list[cf.Future]:
        futs = [self.loop.submit(getattr(c, method)(**kw, **(per_engine(i) if per_engine else {})))
                for i, c in enumerate(self._clients)]
        self._url_of = {f: t.url for f, t in zip(futs, self.targets)}  # the last call's: one call at a time
        return futs

    def wait(self, futs: list[cf.Future], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        pending: set[cf.Future] = set(futs)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            _, pending = cf.wait(pending, timeout=min(left, CANCEL_POLL_S))
            if pending and self.cancel is not None and self.cancel():
                for f in pending:
                    f.cancel()
                raise Cancelled(f"{what}: given up, the job is ending")
        for f in pending:
            f.cancel()
        done = [f for f in futs if f not in pending]
        # an engine that timed out on its own request (its client's bound) did not answer either
        silent = [f for f in futs if f in pending or isinstance(f.exception(), SGLangTimeout)]
        if silent:
            raise Unanswered(what, [self._url_of.get(f, "?") for f in silent], timeout)
        errors = [f.exception() for f in done if f.exception() is not None]
        if errors:
            raise errors[0]

    def call(self, method: str, *, timeout: float, **kw: Any) -> None:
        self.wait(self.submit(method, timeout=timeout, **kw), timeout + 5, method)

    def best_effort(self, method: str, **kw: Any) -> None:
        try:
            self.call(method, timeout=CLEANUP_TIMEOUT_S, **kw)
        except Exception as e:
            log.warning("weight sync cleanup %s: %s", method, e)

    def close(self) -> None:
        async def close_all() -> None:
            await asyncio.gather(*(c.aclose() for c in self._clients), return_exceptions=True)

        if not self.loop.loop.is_running():
            return  # the loop is gone with its sockets; creating the coroutines would only leak them
        coro = close_all()
        try:
            self.loop.submit(coro).result(timeout=5)
        except Exception:
            coro.close()


def release(loop: HttpLoop, targets: list[EngineTarget], api_key: str | None, *, path: Path | None,
            version: int, timeout_s: float) -> list[str]:
    """After a failed broadcast: close the update session, load `path` (disk fallback) and resume
    generation on every engine that answers. Returns the urls that did; an engine that does not
    is left to the rollout supervisor (restarted once the update record is gone) and to the
    driver's disk sync."""
    engines = Engines(loop, targets, api_key)

    async def one(c: SGLangClient) -> bool:
        try:
            await c.end_weight_update(timeout=CLEANUP_TIMEOUT_S)
        except SGLangError:
            pass  # no session open on this engine
        try:
            if path is not None:
                await c.update_weights_from_disk(str(path), weight_version=str(version), timeout=timeout_s)
            await c.continue_generation(timeout=CLEANUP_TIMEOUT_S)
            return True
        except SGLangError as e:
            log.warning("weight sync fallback: %s did not take version %d: %s", c.base_url, version, e)
            return False

    futs = [loop.submit(one(c)) for c in engines._clients]
    done, _ = cf.wait(futs, timeout=timeout_s + 2 * CLEANUP_TIMEOUT_S + 5)
    loaded = [t.url for t, f in zip(targets, futs) if f in done and f.exception() is None and f.result()]
    engines.close()
    return loaded
