"""The trainer's end (rank 0) of an SGLang weight-update process group, built without sglang.

An SGLang engine joins through `/init_weights_update_group`, which calls its
`init_custom_process_group(backend, init_method="tcp://addr:port", world_size, rank, group_name)`
(sglang/srt/utils/common.py, 0.5.23). On the engine that is:

    TCPStore(addr, port)                  client; rank 0 (us) hosts the server
    -> PrefixStore(group_name)            added by sglang
    -> PrefixStore(f"{group_name}/")      added by torch's _new_process_group_helper
    -> PrefixStore(f"{device}/")          the first device of the backend's device map: torch
                                          builds ONE backend when every device maps to the same
                                          one (gloo: cpu+cuda -> "cpu/"; nccl: cuda -> "cuda/")

We build the same chain and the same backend (a gloo backend connects its full mesh in the
constructor, so a backend under another prefix leaves the engine's init waiting for a peer that
never comes), and keep the backend object to ourselves. Nothing is registered with torch.distributed's world, so
torchrun's default group is untouched and this module works in a process that never called
`init_process_group` (the benchmark's sender, the tests).

The trainer's GPU image may not have sglang installed; this module imports only torch.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Literal

import torch
import torch.distributed as dist

from rlslurm import exit_guard
from rlslurm.errors import ConfigError
from rlslurm.net import bound_socket

log = logging.getLogger("rlslurm.trainer.sync_group")

Backend = Literal["gloo", "nccl"]

# The store prefix of the one backend torch builds for a single backend name: the first device of
# Backend.backend_capability (gloo: cpu, cuda; nccl: cuda). Stable since torch 2.0.
STORE_DEVICE: dict[str, str] = {"gloo": "cpu", "nccl": "cuda"}


class SyncGroupError(RuntimeError):
    """Creating the group or a collective on it failed or timed out."""


class NoEngines(SyncGroupError):
    """No engine is there to take the weights (all restarting or gone): nothing to retry or fall back
    to now; the version waits until they are up (trainer/weights/delivery.py)."""


class SyncCancelled(SyncGroupError):
    """A wait given up because its `cancel` said so (the job is ending)."""


# How often a wait looks at its `cancel` (the job ending), as engines/fanout.py's
CANCEL_POLL_S = 0.5


@dataclass(frozen=True)
class GroupSpec:
    master_addr: str
    master_port: int
    world_size: int      # 1 (us) + every engine rank
    group_name: str
    backend: Backend
    timeout_s: float

    def __post_init__(self) -> None:
        if self.backend not in STORE_DEVICE:
            raise ConfigError(f"weight sync backend must be gloo or nccl, got {self.backend!r}")
        if self.world_size < 2:
            raise ConfigError(f"weight-update group {self.group_name!r}: world size {self.world_size} < 2 "
                              "(no engine to send to)")
        if not self.group_name:
            raise ConfigError("weight-update group name must not be empty (SGLang rejects it)")

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)


class SyncGroup:
    """Rank 0 of one weight-update group. `open()` hosts the store and returns at once; `join()`
    blocks until every engine rank has joined (call it while the engines' init requests are in
    flight), `broadcast()` sends from rank 0, `close()` tears everything down."""

    def __init__(self, spec: GroupSpec, *, device: torch.device | None = None, high_priority: bool = False):
        self.spec = spec
        self.high_priority = high_priority
        self.device = device or torch.device("cuda" if spec.backend == "nccl" else "cpu")
        self._store: dist.TCPStore | None = None
        self._prefixed: dist.Store | None = None
        self._backend: dist.Backend | None = None

    @property
    def backend(self) -> dist.Backend:
        if self._backend is None:
            raise SyncGroupError(f"weight-update group {self.spec.group_name!r} is not joined")
        return self._backend

    def open(self) -> "SyncGroup":
        s = self.spec
        sock = None
        try:
            # Bound to the address the engines dial, not every interface (torch's own bind): the store
            # has no authentication (docs/security.md). torch takes the fd over and closes it.
            sock = bound_socket(s.master_addr, s.master_port)
            # wait_for_workers=False: the engines connect when their HTTP init arrives, which the
            # caller sends after this returns; `join()` is where we wait for them.
            self._store = dist.TCPStore(s.master_addr, s.master_port, s.world_size, True, s.timeout,
                                        wait_for_workers=False, master_listen_fd=sock.fileno())
            sock.detach()
        except (RuntimeError, OSError) as e:
            if sock is not None:
                sock.close()
            raise SyncGroupError(f"cannot host the weight-sync store on {s.master_addr}:{s.master_port}: {e}") from e
        self._prefixed = dist.PrefixStore(f"{s.group_name}/", dist.PrefixStore(s.group_name, self._store))
        return self

    def join(self, *, cancel: Callable[[], bool] | None = None) -> None:
        """Build the backend: gloo waits for every rank here, bounded by the spec's timeout (NCCL
        only exchanges its id through the store on the first collective). `cancel`: checked while
        waiting; true raises `SyncCancelled` (the build goes on in its daemon thread until the
        engines join or the timeout fails it, which nobody waits for)."""
        s = self.spec
        if self._prefixed is None:
            raise SyncGroupError("open() the group before join()")
        t0 = time.monotonic()
        store = dist.PrefixStore(f"{STORE_DEVICE[s.backend]}/", self._prefixed)
        box: dict[str, Any] = {}

        def build() -> None:
            try:
                be = self._make_backend(store)
                if hasattr(be, "_set_sequence_number_for_group"):  # what torch does after building it
                    be._set_sequence_number_for_group()
                box["backend"] = be
            except BaseException as e:  # handed to the waiting thread
                box["error"] = e

        if cancel is None:
            build()
        else:
            worker = threading.Thread(target=build, name=f"join-{s.group_name}", daemon=True)
            worker.start()
            while worker.is_alive():
                worker.join(CANCEL_POLL_S)
                if worker.is_alive() and cancel():
                    exit_guard.leave_behind(worker)  # its exit must step around it
                    raise SyncCancelled(f"weight-update group {s.group_name!r}: joining given up, the job is ending")
        e = box.pop("error", None)
        store = build = None  # type: ignore[assignment]  # the port must be free once close() drops ours
        if isinstance(e, (RuntimeError, dist.DistError)):
            msg = (f"weight-update group {s.group_name!r} on {s.master_addr}:{s.master_port}: engines did not join "
                   f"within {s.timeout_s:g} s ({time.monotonic() - t0:.1f} s): {e}")
            e.__traceback__ = None  # its frames hold the store
            raise SyncGroupError(msg) from e
        if e is not None:
            raise e
        self._backend = box["backend"]
        # NCCL connects lazily, on the first bucket: no warm-up collective here, the engines post
        # a receive only for what /update_weights_from_distributed names (one would deadlock).

    def _make_backend(self, store: dist.Store) -> dist.Backend:
        s = self.spec
        if s.backend == "gloo":
            return dist.ProcessGroupGloo(store, 0, s.world_size, s.timeout)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = s.timeout + NCCL_WATCHDOG_MARGIN
        opts.is_high_priority_stream = self.high_priority
        opts.group_name = s.group_name
        return dist.ProcessGroupNCCL(store, 0, s.world_size, opts)

    def broadcast(self, tensors: list[torch.Tensor], *, timeout_s: float | None = None,
                  cancel: Callable[[], bool] | None = None) -> None:
        """Broadcast each tensor from rank 0, in order (the engine posts one receive per tensor
        of the bucket, in the order of the names it was given), then wait for all of them.
        `timeout_s` bounds this call (default: the spec's timeout)."""
        self.finish(self.start(tensors, timeout_s=timeout_s), timeout_s=timeout_s, cancel=cancel)

    def start(self, tensors: list[torch.Tensor], *, timeout_s: float | None = None) -> list:
        """Post the broadcasts of `tensors` and return their works without waiting (`finish` waits).
        The tensors must stay alive until then."""
        limit = self.spec.timeout if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        works = []
        try:
            for t in tensors:
                opts = dist.BroadcastOptions()
                opts.rootRank, opts.rootTensor = 0, 0
                # NCCL's watchdog kills the whole process when a work outlives its timeout; our own
                # deadline (finish) must come first, so that a failed sync is an error we handle.
                # gloo has no watchdog: its timeout is what unblocks a send to a peer that stopped reading.
                opts.timeout = limit + NCCL_WATCHDOG_MARGIN if self.spec.backend == "nccl" else limit
                works.append(self.backend.broadcast([t], opts))
        except (RuntimeError, dist.DistError) as e:
            raise SyncGroupError(f"broadcast on weight-update group {self.spec.group_name!r} failed: {e}") from e
        return works

    def finish(self, works: list, *, timeout_s: float | None = None, cancel: Callable[[], bool] | None = None) -> None:
        limit = self.spec.timeout if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        try:
            _wait_all(works, time.monotonic() + limit.total_seconds(), cancel)
        except (RuntimeError, dist.DistError) as e:
            raise SyncGroupError(f"broadcast on weight-update group {self.spec.group_name!r} failed or timed out "
                                 f"(limit {limit.total_seconds():g} s): {e}") from e

    def close(self) -> None:
        """Drop the backends (closes their connections, which fails any engine still blocked in a
        receive instead of leaving it hanging for its own 30-minute default) and the store."""
        be, self._backend = self._backend, None
        if be is not None:
            try:
                if hasattr(be, "abort"):
                    be.abort()
                elif hasattr(be, "shutdown"):
                    be.shutdown()
            except Exception:  # teardown of a broken group: nothing more to do than drop it
                log.debug("closing the backend of %s failed", self.spec.group_name, exc_info=True)
            del be
        self._prefixed = None
        self._store = None

    def __enter__(self) -> "SyncGroup":
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()


# The longest sleep between two polls of a broadcast's works: the bound on how late a completed
# bucket is noticed (bench/bench_engine_sync.py measures the sync with it and with 1 ms).
POLL_MAX_S = 0.01
# How much later than our own deadline NCCL's watchdog may act on a weight-update work: with equal
# timeouts the watchdog SIGABRTed the trainer (a broadcast to an engine that had died) before
# `_wait_all` raised and `close()` aborted the communicator (bench/results/engine-sync-h200x2-receiver.md).
NCCL_WATCHDOG_MARGIN = datetime.timedelta(seconds=120)


def _wait_all(works: list, deadline: float, cancel: Callable[[], bool] | None = None) -> None:
    """Block until every work has completed, or raise at `deadline`. NCCL's `Work.wait(timeout)` does
    not block the caller (it only orders the current stream after the collective), so a receiver that
    never completes would surface only at the trainer's next synchronisation, with no bound; polling
    `is_completed()` keeps the bound, and `close()` then aborts the communicator. A peer that fails
    inside NCCL's connection set-up blocks the broadcast call itself, before there is a work to poll:
    that case is not bounded here (docs/gpu.md)."""
    pause, next_look = 1e-4, time.monotonic() + CANCEL_POLL_S
    for w in works:
        while not w.is_completed():
            now = time.monotonic()
            if now > deadline:
                raise SyncGroupError(f"broadcast did not complete by its deadline ({len(works)} tensor(s))")
            if cancel is not None and now > next_look:
                next_look = now + CANCEL_POLL_S
                if cancel():
                    raise SyncCancelled("broadcast given up, the job is ending")
            time.sleep(pause)
            pause = min(pause * 2, POLL_MAX_S)
        w.wait()  # raises the work's own error, if any; completed, so it does not block


def iter_buckets(stream: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                 device: torch.device, *, one_dtype: bool = False) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group `(name, tensor)` into lists of about `bucket_bytes` (a larger tensor goes alone),
    each tensor contiguous on `device`. Buckets bound the memory held and the size of one HTTP
    request's name list; one gathered tensor is pulled from the export at a time. `one_dtype`: a
    dtype change starts a new bucket (a flattened bucket's tensors must start at offsets aligned
    to their element size: SGLang 0.5.23 refuses others)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in stream:
        t = t.detach().to(device).contiguous()
        nbytes = t.numel() * t.element_size()
        if bucket and (size + nbytes > bucket_bytes or (one_dtype and t.dtype != bucket[0][1].dtype)):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


def flatten_bucket(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The bytes of each tensor, in order, as one uint8 tensor: what an engine told
    `load_format: flattened_bucket` allocates, receives in one broadcast and views back into the
    named tensors by their dtypes and shapes (docs/sglang-behaviour.md)."""
    return torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])
