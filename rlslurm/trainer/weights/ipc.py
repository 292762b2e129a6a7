"""Weights to colocated engines in place: `ipc_publisher`, the --colocate publisher
(`--weight-sync-transport ipc`, the default there; docs/colocate.md).

Every trainer rank exports the whole model (gathered over TP/EP within its own replica) and copies it,
bucket by bucket, into one of two buffers on its own GPU. The engine rank on that GPU reads the bucket
from there (a CUDA IPC handle; a memfd on CPU: engines/shared_buffer.py) with rlslurm's receiver
(engines/receiver.py) and copies it into its parameters. One /update_weights_from_tensor request per
bucket and engine, sent by the trainer rank on the engine's first GPU, with one entry per TP rank of the
engine (SGLang hands entry i to TP rank i). Nothing goes through host memory or a process group: NCCL
refuses two ranks on one GPU, which is why the broadcast needed gloo here (bench/results/colocate-h100.md).

For bucket k, one request per engine in flight while the next bucket is exported and copied:

    every rank     copy bucket k into its buffer k % 2
    engine leads   wait for bucket k-1's requests (they read buffer (k-1) % 2, which bucket k+1 overwrites)
    TP>1 engines   all_gather of every rank's buffer (each lead needs its TP ranks' buffers; passing the
                   gather also tells every rank that the wait before it is over)
    engine leads   POST bucket k

Which trainer rank serves which engine rank: on CUDA the one on the same GPU of the same node (the
engines' gpu_ids in control/engines.json, the trainer's current device); on CPU the node's engine ranks
in order, dealt round robin to the node's trainer ranks. An engine spanning nodes (engines/span.py) has
its TP ranks on each of its nodes in turn (`nodes` in engines.json), each served on its own node; its
requests go to node rank 0, which hands every TP rank its own entry wherever it runs.

The bracket around it (weight_update.json, pause, begin/end_weight_update, the version, continue or
stay paused inside --colocate's turn, tries and the disk fallback) is tries.py's, the same as the
broadcast's: this module supplies the transport (`Ipc`), composed into that `SyncPublisher`.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from rlslurm.buffer.control import Control
from rlslurm.engines.fanout import REFUSED_TIMEOUT_S, Engines, EngineTarget, HttpLoop, engine_targets, refusing
from rlslurm.engines.receiver import LOADER as RECEIVER_LOADER, mapped_payload
from rlslurm.engines.shared_buffer import MemfdBuffer, cuda_source
from rlslurm.errors import ConfigError
from rlslurm.settings.weight_plan import delivered_by
from rlslurm.trainer.weights.base import Roles, SyncOptions, megatron_roles
from rlslurm.trainer.weights.buckets import SendStats, bucket_plan, serialized_plan
from rlslurm.trainer.weights.group import NoEngines, SyncGroupError, iter_buckets
from rlslurm.trainer.weights.tries import SyncPublisher

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Found:
    """An engine of control/engines.json, where it runs."""
    target: EngineTarget
    nodes: tuple[str, ...]     # the node of each of its node ranks (one unless it spans nodes)
    gpu_ids: tuple[int, ...]   # its TP ranks' GPUs on each of those nodes; () on CPU

    def place(self, j: int) -> tuple[str, int | None]:
        """TP rank j's node and GPU: SGLang numbers the ranks node by node."""
        per = max(1, self.target.ranks // len(self.nodes))
        return self.nodes[j // per], self.gpu_ids[j % per] if self.gpu_ids else None


@dataclass(frozen=True)
class Server:
    """A trainer rank, where it runs."""
    rank: int
    node: str
    gpu: int | None            # its CUDA device; None on CPU
    local_rank: int


def assign(engines: list[Found], servers: list[Server]) -> list[list[int]]:
    """For each engine, the trainer rank that serves each of its TP ranks (see the module docstring)."""
    out: list[list[int]] = []
    dealt: dict[str, int] = {}
    for e in engines:
        ranks = []
        for j in range(e.target.ranks):
            node, gpu = e.place(j)
            here = sorted((s for s in servers if s.node == node), key=lambda s: s.local_rank)
            if not here:
                raise ConfigError(f"weights by IPC: TP rank {j} of engine {e.target.url} runs on node {node!r}, where "
                                  f"no trainer rank runs (trainer nodes: {sorted({s.node for s in servers})}); the IPC "
                                  "transport needs the engines on the trainer's nodes (--colocate)")
            if gpu is not None:
                s = next((s for s in here if s.gpu == gpu), None)
                if s is None:
                    raise ConfigError(f"weights by IPC: TP rank {j} of engine {e.target.url} "
                                      f"is on GPU {gpu} of {node}, where no trainer rank runs (trainer GPUs there: "
                                      f"{sorted(s.gpu for s in here if s.gpu is not None)})")
                ranks.append(s.rank)
            else:
                i = dealt.get(node, 0)
                dealt[node] = i + 1
                ranks.append(here[i % len(here)].rank)
        out.append(ranks)
    return out


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_gather(obj: Any) -> list[Any]:
    world = _world()[1]
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _broadcast(obj: Any) -> Any:
    if _world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class _Buffers:
    """This rank's two buffers, at least `min_bytes` each, grown for a larger bucket. On CUDA they
    live for one publish (the engines need the memory back); the memfds on CPU stay."""

    def __init__(self, device: torch.device, min_bytes: int):
        self.device, self.min_bytes = device, min_bytes
        self.cuda: list[torch.Tensor | None] = [None, None]
        self.memfd: list[MemfdBuffer | None] = [None, None]

    def write(self, k: int, bucket: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        """Copy the bucket's bytes into buffer k % 2; its source (after the copy is enqueued)."""
        i = k % 2
        n = sum(t.numel() * t.element_size() for _, t in bucket)
        parts = [t.reshape(-1).view(torch.uint8) for _, t in bucket]
        if self.device.type == "cuda":
            buf = self.cuda[i]
            if buf is None or buf.numel() < n:
                self.cuda[i] = buf = None  # the old one goes first
                buf = self.cuda[i] = torch.empty(max(n, self.min_bytes), dtype=torch.uint8, device=self.device)
            torch.cat(parts, out=buf[:n])
            return cuda_source(buf[:n])
        mb = self.memfd[i]
        if mb is None or mb.nbytes < n:
            if mb is not None:
                mb.close()
            mb = self.memfd[i] = MemfdBuffer(max(n, self.min_bytes))
        torch.cat(parts, out=mb.tensor[:n])
        return mb.source(n)

    def end_publish(self) -> None:
        if self.device.type == "cuda" and any(b is not None for b in self.cuda):
            self.cuda = [None, None]
            torch.cuda.ipc_collect()  # blocks the engines still had open: freed once they let go

    def close(self) -> None:
        self.end_publish()
        for mb in self.memfd:
            if mb is not None:
                mb.close()
        self.memfd = [None, None]


class IpcSender:
    """One trainer rank's side of the IPC transport: which engines it serves, its buffers, its
    requests. `engines` (every engine) is for the coordinator's bracket calls."""

    def __init__(self, control: Control, api_key: str | None, opts: SyncOptions, *, device: torch.device, node: str,
                 ending: Callable[[], bool] | None = None):
        self.control, self.api_key, self.opts, self.device, self.node = control, api_key, opts, device, node
        self.ending = ending
        self.rank = _world()[0]
        self._loop = HttpLoop()
        self.buffers = _Buffers(device, opts.bucket_bytes)
        self.found: list[Found] | None = None
        self.engines: Engines | None = None   # all of them
        self.led: Engines | None = None       # those whose TP rank 0 this rank serves
        self.led_servers: list[list[int]] = []  # for each led engine, the server of each TP rank
        self.serves = False                   # whether any engine rank reads this rank's buffers
        self.cross_rank = False               # an engine with TP ranks served by several trainer ranks
        self.last = SendStats()
        self.unanswered: set[tuple[str, int | None, int]] = set()  # as StageSender's

    def whoami(self) -> Server:
        gpu = self.device.index if self.device.type == "cuda" else None
        return Server(self.rank, self.node, gpu, int(os.environ.get("LOCAL_RANK", "0")))

    def discover(self) -> list[Found]:
        """The healthy engines of engines.json that accept connections (rank 0; see StageSender)."""
        records = [r for r in self.control.engines() if r.healthy]
        urls = [r.url for r in records]
        gone = set(self._loop.submit(refusing(urls)).result(timeout=REFUSED_TIMEOUT_S + 5))
        if gone:
            log.warning("weights by IPC: leaving out %s (connection refused: exited or restarting; a later sync "
                        "includes it again)", sorted(gone))
        targets = engine_targets(records)
        self.unanswered &= {t.identity for t in targets}
        hung = {t.url for t in targets if t.identity in self.unanswered}
        if hung:
            log.warning("weights by IPC: leaving out %s (did not answer the last try; its supervisor checks it now)",
                        sorted(hung))
        found = [Found(t, tuple(r.nodes or [r.node]), tuple(r.gpu_ids))
                 for r, t in zip(records, targets, strict=True) if r.url not in gone | hung]
        if not found:
            raise NoEngines(f"{self.control.dir}/engines.json lists no healthy engine to send weights to")
        return found

    def prepare(self, found: list[Found], servers: list[Server]) -> None:
        """Every rank, with the same `found`: which engines this rank leads and whose buffers they read."""
        if found == self.found and self.engines is not None:
            return
        self.teardown()
        by_engine = assign(found, servers)
        mine = [i for i, ranks in enumerate(by_engine) if ranks[0] == self.rank]
        self.engines = Engines(self._loop, [f.target for f in found], self.api_key, cancel=self.ending)
        self.led = Engines(self._loop, [found[i].target for i in mine], self.api_key, cancel=self.ending)
        self.led_servers = [by_engine[i] for i in mine]
        self.serves = any(self.rank in ranks for ranks in by_engine)
        self.cross_rank = any(len(set(ranks)) > 1 for ranks in by_engine)
        self.found = found

    def send(self, stream: Iterable[tuple[str, torch.Tensor]]) -> SendStats:
        """Every rank, in step (see the module docstring). A failure is carried to the end of the
        stream (the export's gathers and, for TP>1 engines, the per-bucket all_gather go on) and then
        raised on every rank that saw it."""
        if self.engines is None or self.led is None:
            raise SyncGroupError("prepare() before send()")
        to = self.opts.timeout_s
        stats, t0 = SendStats(), time.perf_counter()
        inflight: list[Any] = []
        failed: str | None = None
        it = iter(stream)
        try:
            for k, bucket in enumerate(iter_buckets(it, self.opts.bucket_bytes, self.device, one_dtype=True)):
                src = None
                if failed is None and self.serves:
                    try:
                        src = self.buffers.write(k, bucket)
                    except Exception as e:  # carried: the others are in step with us
                        failed = f"rank {self.rank}: copying bucket {k}: {e}"
                if failed is None and inflight:
                    try:
                        self.led.wait(inflight, to, "update_weights_from_tensor")
                    except Exception as e:
                        failed = f"rank {self.rank}: {e}"
                    inflight = []
                if self.cross_rank:
                    everyone = _all_gather((src, failed))
                    failed = failed or next((f for _, f in everyone if f), None)
                    sources = {r: s for r, (s, _) in enumerate(everyone)}
                else:
                    sources = {self.rank: src}
                if failed is None:
                    inflight = self._post(bucket, sources, to)
                    stats.count(bucket)
            if failed is None and inflight:
                self.led.wait(inflight, to, "update_weights_from_tensor")
                inflight = []
        except BaseException:
            for _ in it:  # our part of the export's remaining gathers
                pass
            raise
        finally:
            for f in inflight:
                f.cancel()
            self.buffers.end_publish()
        if failed is not None:
            raise SyncGroupError(failed)
        stats.seconds = time.perf_counter() - t0
        self.last = stats
        return stats

    def _post(self, bucket: list[tuple[str, torch.Tensor]], sources: dict[int, Any], to: float) -> list[Any]:
        assert self.led is not None
        if not self.led_servers:
            return []
        plan = [bucket_plan(bucket)]
        entries = [[serialized_plan(mapped_payload(plan, [sources[r]])) for r in ranks] for ranks in self.led_servers]
        return self.led.submit("update_weights_from_tensor", lambda i: {"serialized_named_tensors": entries[i]},
                               load_format=RECEIVER_LOADER, flush_cache=True, timeout=to)

    def teardown(self) -> None:
        for e in (self.engines, self.led):
            if e is not None:
                e.close()
        self.engines = self.led = None
        self.found = None
        self.buffers.end_publish()

    def close(self) -> None:
        self.teardown()
        self.buffers.close()
        self._loop.close()


def ipc_roles() -> Roles:
    """Every rank exports and sends (to the engines on its own GPU); global rank 0 brackets the update."""
    r = megatron_roles()
    if r.stages > 1:
        raise ConfigError("--weight-sync-transport ipc needs every trainer rank to hold whole layers: pipeline "
                          "parallelism 1 (or --weight-sync-transport broadcast)")
    return replace(r, exporter=True, leader=True, coordinator=_world()[0] == 0)


class Ipc:
    """The IPC transport (base.py `Transport`; see the module docstring). `node`: this rank's node, as
    the rollout nodes name theirs in engines.json."""

    sent = "copied in place"

    def __init__(self, *, node: str, roles: Callable[[], Roles] = ipc_roles):
        self.node, self._roles = node, roles
        self._servers: list[Server] | None = None

    def roles(self) -> Roles:
        return self._roles()

    def name(self, opts: SyncOptions, r: Roles) -> str:
        return delivered_by("ipc", opts.backend, r.device.type)

    def new_sender(self, pub: SyncPublisher, r: Roles) -> IpcSender:
        return IpcSender(pub.control, pub.api_key, pub.opts, device=r.device, node=self.node, ending=pub.ending)

    def join(self, pub: SyncPublisher, r: Roles, ok: bool, errors: list[str]) -> bool:
        s = pub.sender
        assert isinstance(s, IpcSender)
        if self._servers is None:
            self._servers = _all_gather(s.whoami())
        found: list[Any] = [None]
        if ok and r.coordinator:
            pub.step("finding engines", lambda: found.__setitem__(0, s.discover()), errors)
        found[0] = _broadcast(found[0])
        if found[0] is None:
            return False
        servers = self._servers
        return pub.step("assigning engines", lambda: s.prepare(found[0], servers), errors)

    def transfer(self, pub: SyncPublisher, model: torch.nn.Module, r: Roles, ok: bool, errors: list[str]) -> bool:
        if ok:
            s = pub.sender
            assert isinstance(s, IpcSender)
            stream = pub.stream(model)
            ok = pub.step("copying to the engines", lambda: s.send(stream), errors)
        return pub.agree(ok)

    def refusal_detail(self, pub: SyncPublisher, r: Roles) -> str:
        return ""  # no group: nothing NCCL could refuse


def ipc_publisher(mc: Any, control: Control, *, node: str, roles: Callable[[], Roles] = ipc_roles,
                  **kw: Any) -> SyncPublisher:
    """The publisher of --weight-sync-transport ipc; `kw`: SyncPublisher's (api_key, opts, fallback,
    attempt, export, ending, note)."""
    return SyncPublisher(Ipc(node=node, roles=roles), mc, control, **kw)
