"""Weight sync by broadcast: `DistributedPublisher`, the `weight_sync: distributed` publisher.

One weight-update group per pipeline stage: the trainer rank with DP=0, TP=0 (EP=0) of the stage
is rank 0 (the stage's *leader*), every engine rank follows (`rank_offset`), world size = engine
ranks + 1. The group is built by `sync_group.SyncGroup` (no sglang import, torchrun's default
group untouched) on a fresh port each time, and rebuilt whenever the engine set in
control/engines.json changes (an engine restarted by the rollout supervisor has a new pid and
restart count and re-joins here) or a sync failed.

One publish, every trainer rank calling `publish(model, version)`:

    stage-0 leader   control/weight_update.json (Control.mark_weight_update: "updating" until ...)
    each leader      in stage order, (re)builds its stage's group if the engine set changed
                     (engines block in the join, one group at a time)
    stage-0 leader   POST /pause_generation, /begin_weight_update to every engine
    stage s, in turn the DP=0 ranks export (gathered over TP/EP, HF names, `mcore_to_hf`);
                     the leader packs buckets of `bucket_bytes` and for each bucket sends
                     /update_weights_from_distributed (names/dtypes/shapes) to every engine
                     at once while broadcasting the bucket's tensors
    stage-0 leader   /end_weight_update, /update_weight_version, /continue_generation;
                     Control.set_weight_version(version); Control.clear_weight_update()

Ranks agree on success after each phase (an all-reduce over the default group), so a failure on
one leader is seen by every rank at the same point. Every HTTP call and collective is bounded by
`timeout_s`. A failed attempt tears the group down (the engines' pending receives fail once our
connections close) and the next attempt rebuilds it; after `attempts` failed attempts the
version is published by the fallback (disk: `DiskPublisher` writes weights/v<N>/, the stage-0
leader loads it into every engine that answers), or with no fallback `WeightSyncError` is raised
so the step fails and SLURM's requeue takes over. It never waits without a bound.

The rollout side must not restart an engine that is blocked in a join or a broadcast (it answers
neither /health nor /generate): every rollout node's `UpdateWatcher` (engines/update_watch.py) holds
`EngineSupervisor.pause_health_checks()` while weight_update.json is present and fresh, for at
most the timeout plus a margin.

The HTTP side (engine targets, one call to every engine at once, releasing them after a failure)
is engines/fanout.py; this module is the torch.distributed side and the protocol's order.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal

import torch
import torch.distributed as dist

from rlslurm.buffer.control import Control, RendezvousRecord, RendezvousTaken
from rlslurm.engines.fanout import (
    REFUSED_TIMEOUT_S,
    Engines,
    EngineTarget,
    HttpLoop,
    dtype_name,
    engine_targets,
    refusing,
    release,
)
from rlslurm.engines.receiver import LOADER as RECEIVER_LOADER
from rlslurm.engines.receiver import BucketPlan, plan_payload
from rlslurm.errors import ConfigError, UserError
from rlslurm.net import free_port, node_ip
from rlslurm.trainer.collectives import collective_device
from rlslurm.trainer.sync_group import GroupSpec, SyncGroup, SyncGroupError, flatten_bucket, iter_buckets

log = logging.getLogger("rlslurm.trainer.weight_sync")


class WeightSyncError(UserError):
    """A weight sync failed after every attempt and no fallback was configured: the step fails
    and the job's requeue restarts it."""


@dataclass(frozen=True)
class SyncOptions:
    bucket_bytes: int = 512 * 1024**2       # train.update_weight_buffer_size
    timeout_s: float = 300.0                # train.weight_sync_timeout_s: bound of every step
    attempts: int = 2                       # distributed tries per publish, each on a fresh group
    backend: Literal["gloo", "nccl"] | None = None   # None: nccl when the trainer is on CUDA
    dtype: torch.dtype | None = None        # cast while exporting (None: the parameters' dtype)
    pause_mode: Literal["abort", "retract", "in_place"] = "abort"
    group_prefix: str = "rlslurm-wsync"
    flattened: bool = False                 # train.update_weight_flattened_bucket: one broadcast per bucket
    receiver: Literal["sglang", "rlslurm"] = "sglang"  # train.update_weight_receiver (engines/receiver.py)

    def __post_init__(self) -> None:
        if self.bucket_bytes < 1:
            raise ConfigError(f"update_weight_buffer_size must be >= 1 byte, got {self.bucket_bytes}")
        if self.timeout_s <= 0:
            raise ConfigError(f"weight_sync_timeout_s must be > 0, got {self.timeout_s}")
        if self.attempts < 1:
            raise ConfigError(f"weight sync attempts must be >= 1, got {self.attempts}")

    @classmethod
    def from_config(cls, cfg: Any, **kw: Any) -> "SyncOptions":
        """From the run config: train.update_weight_buffer_size, weight_sync_timeout_s and
        weight_sync_backend. Its `auto` is NCCL on CUDA, except where the engines share the trainer's
        GPUs (--shared-gpu, --colocate): an engine on the trainer's own GPU cannot join an NCCL group
        with it (docs/gpu.md), gloo can."""
        t = cfg.train
        backend = t.weight_sync_backend
        if backend == "auto":
            backend = "gloo" if cfg.shares_gpus else None
        return cls(bucket_bytes=t.update_weight_buffer_size, timeout_s=t.weight_sync_timeout_s, backend=backend,
                   flattened=t.update_weight_flattened_bucket, receiver=t.update_weight_receiver, **kw)


# --- one stage's leader -------------------------------------------------------------------

@dataclass
class SendStats:
    tensors: int = 0
    buckets: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def count(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        self.buckets += 1
        self.tensors += len(bucket)
        self.bytes += sum(t.numel() * t.element_size() for _, t in bucket)


class StageSender:
    """Rank 0 of one stage's weight-update group: (re)builds it for the current engines and
    sends buckets. Used only on the stage's leader; knows nothing about Megatron."""

    def __init__(self, control: Control, api_key: str | None, opts: SyncOptions, *, stage: int = 0,
                 attempt: int = 0, host: str | None = None, device: torch.device | None = None):
        self.control, self.api_key, self.opts = control, api_key, opts
        self.stage, self.attempt = stage, attempt
        self.host = host or node_ip()
        self.device = device or torch.device("cpu")
        backend = opts.backend or ("nccl" if self.device.type == "cuda" else "gloo")
        self.backend: Literal["gloo", "nccl"] = backend
        self._loop = HttpLoop()
        self.engines: Engines | None = None
        self.group: SyncGroup | None = None
        self._builds = 0
        self.last = SendStats()
        # rlslurm's receiver: the bucket layout of the last publish, sent ahead as the plan of the next
        self._plan: list[BucketPlan] | None = None

    # -- group -----------------------------------------------------------------------------
    def current_targets(self) -> list[EngineTarget]:
        return engine_targets(self.control.engines())

    def ensure_group(self, targets: list[EngineTarget] | None = None) -> None:
        """Build the group unless one exists for exactly these engines (url, pid, restarts).
        Engines that refuse connections are left out: engines.json lags a kill by up to the
        supervisor's health interval, and a dead engine would hold the join for its timeout."""
        targets = self.current_targets() if targets is None else targets
        gone = self._loop.submit(refusing([t.url for t in targets])).result(timeout=REFUSED_TIMEOUT_S + 5)
        if gone:
            log.warning("weight sync: leaving out %s (connection refused: exited or restarting; a later sync "
                        "includes it again)", gone)
            targets = [t for t in targets if t.url not in gone]
        if not targets:
            raise SyncGroupError(f"{self.control.dir}/engines.json lists no healthy engine to send weights to"
                                 + (f" ({len(gone)} refused connections)" if gone else ""))
        if self.group is not None and self.engines is not None and self.engines.targets == targets:
            return
        self.teardown()
        self._build(targets)

    def _build(self, targets: list[EngineTarget]) -> None:
        o = self.opts
        self._builds += 1
        name = f"{o.group_prefix}-a{self.attempt}-pp{self.stage}-b{self._builds}"
        world = 1 + sum(t.ranks for t in targets)
        group = None
        for _ in range(3):  # a port picked free can be taken before the store binds it
            spec = GroupSpec(self.host, free_port(self.host), world, name, self.backend, o.timeout_s)
            try:
                group = SyncGroup(spec, device=self.device).open()
                break
            except SyncGroupError as e:
                log.warning("%s; trying another port", e)
        if group is None:
            raise SyncGroupError(f"could not host a weight-sync store on {self.host} (3 ports tried)")
        self._record(group.spec)
        engines = Engines(self._loop, targets, self.api_key)
        offsets = [1 + sum(t.ranks for t in targets[:i]) for i in range(len(targets))]
        t0 = time.monotonic()
        futs = engines.submit("init_weights_update_group", lambda i: {"rank_offset": offsets[i]},
                              master_address=group.spec.master_addr, master_port=group.spec.master_port,
                              world_size=world, group_name=name, backend=self.backend, timeout=o.timeout_s)
        try:
            group.join()
            Engines.wait(futs, o.timeout_s, "init_weights_update_group")
        except BaseException:
            group.close()  # closes the store: engines still waiting in their init fail now
            engines.close()
            raise
        self.group, self.engines = group, engines
        log.info("weight-sync group %s: %d engine(s), world %d, %s on %s:%d, joined in %.2f s", name, len(targets),
                 world, self.backend, group.spec.master_addr, group.spec.master_port, time.monotonic() - t0)

    def _record(self, spec: GroupSpec) -> None:
        """The attempt's rendezvous record (first group of stage 0): O_EXCL, so a stale trainer
        of the same attempt learns it is stale instead of pointing engines at another port."""
        if self.stage != 0 or self._builds != 1:
            return
        rec = RendezvousRecord(master_addr=spec.master_addr, master_port=spec.master_port,
                               world_size=spec.world_size, group_name=spec.group_name, attempt=self.attempt)
        try:
            self.control.publish_rendezvous(rec)
        except RendezvousTaken:
            raise WeightSyncError(f"{self.control.rendezvous_path(self.attempt)}: another trainer of attempt "
                                  f"{self.attempt} already published its weight-sync rendezvous") from None

    def teardown(self) -> None:
        """Destroy the group on the engines (best effort, bounded) and drop ours."""
        group, engines, self.group, self.engines = self.group, self.engines, None, None
        if group is not None:
            # Close ours first: an engine blocked in a receive is released by the closed sockets
            # and can then answer the destroy.
            group.close()
        if engines is not None:
            if group is not None:
                engines.best_effort("destroy_weights_update_group", group_name=group.spec.group_name)
            engines.close()

    # -- sending ---------------------------------------------------------------------------
    def send(self, stream: Iterable[tuple[str, torch.Tensor]]) -> SendStats:
        """Broadcast every tensor of `stream` in buckets of about `bucket_bytes`. On failure the
        stream is still drained (TP peers are gathering in step with us) and the error raised."""
        if self.group is None or self.engines is None:
            raise SyncGroupError("ensure_group() before send()")
        stats, t0 = SendStats(), time.perf_counter()
        it = iter(stream)
        receiver = self.opts.receiver == "rlslurm"
        try:
            if receiver and self._plan is not None:
                self._send_planned(it, stats)
            else:
                layout: list[BucketPlan] = []
                flattened = self.opts.flattened or receiver  # the receiver's plan is of flattened buckets
                for bucket in iter_buckets(it, self.opts.bucket_bytes, self.device, one_dtype=flattened):
                    self._send_bucket(bucket, stats, flattened=flattened)
                    layout.append(bucket_plan(bucket))
                if receiver:  # the next publish sends the same layout in one request
                    self._plan = layout
        except BaseException:
            self._plan = None  # a failed publish falls back to SGLang's requests next time
            for _ in it:
                pass
            raise
        stats.seconds = time.perf_counter() - t0
        self.last = stats
        return stats

    def _send_planned(self, it: Iterator[tuple[str, torch.Tensor]], stats: SendStats) -> None:
        """rlslurm's receiver: one request to every engine carrying the plan (the layout of the last
        publish), then every bucket's bytes back to back while the engines copy the previous one."""
        assert self.group is not None and self.engines is not None and self._plan is not None
        to, plan = self.opts.timeout_s, self._plan
        payload = serialized_plan(plan_payload(self.group.spec.group_name, plan))
        targets = self.engines.targets
        futs = self.engines.submit("update_weights_from_tensor",
                                   lambda i: {"serialized_named_tensors": [payload] * targets[i].ranks},
                                   load_format=RECEIVER_LOADER, flush_cache=True, timeout=to)
        # Two buckets in flight: the next one is flattened while the previous is on the wire, and the
        # wait for a completed broadcast (polled: sync_group._wait_all) is not paid per bucket.
        in_flight: list[tuple[torch.Tensor, list]] = []
        try:
            for k, bucket in enumerate(iter_buckets(it, self.opts.bucket_bytes, self.device, one_dtype=True)):
                if k >= len(plan) or bucket_plan(bucket) != plan[k]:
                    # the engines wait for the planned bytes: fail this attempt (its group is torn down)
                    raise SyncGroupError(f"weight sync: bucket {k} differs from the plan sent to the engines")
                flat = flatten_bucket([t for _, t in bucket])
                if len(in_flight) == 2:
                    self.group.finish(in_flight.pop(0)[1])
                in_flight.append((flat, self.group.start([flat])))
                stats.count(bucket)
            for _, works in in_flight:
                self.group.finish(works)
        except BaseException:
            for f in futs:
                f.cancel()
            raise
        Engines.wait(futs, to, "update_weights_from_tensor")

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], stats: SendStats, *, flattened: bool) -> None:
        assert self.group is not None and self.engines is not None
        to = self.opts.timeout_s
        # flattened: one broadcast of the bucket's bytes instead of one per tensor (SGLang's
        # flattened_bucket receive; docs/sglang-behaviour.md)
        tensors = [flatten_bucket([t for _, t in bucket])] if flattened else [t for _, t in bucket]
        extra = {"load_format": "flattened_bucket"} if flattened else {}
        futs = self.engines.submit(
            "update_weights_from_distributed", names=[n for n, _ in bucket],
            dtypes=[dtype_name(t.dtype) for _, t in bucket], shapes=[list(t.shape) for _, t in bucket],
            group_name=self.group.spec.group_name, flush_cache=True, timeout=to, **extra)
        try:
            self.group.broadcast(tensors)
        except SyncGroupError:
            for f in futs:
                f.cancel()
            raise
        Engines.wait(futs, to, "update_weights_from_distributed")
        stats.count(bucket)

    def close(self) -> None:
        self.teardown()
        self._loop.close()


# --- the publisher ------------------------------------------------------------------------

@dataclass
class _Roles:
    exporter: bool     # takes part in the export gather (DP=0)
    leader: bool       # rank 0 of its stage's group
    coordinator: bool  # the stage-0 leader: brackets the update, records the version
    stage: int
    stages: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


def _megatron_roles() -> _Roles:
    from megatron.core import parallel_state as ps

    dp0 = ps.get_data_parallel_rank() == 0
    leader = dp0 and ps.get_tensor_model_parallel_rank() == 0 and ps.get_expert_model_parallel_rank() == 0
    stage, stages = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return _Roles(exporter=dp0, leader=leader, coordinator=leader and stage == 0, stage=stage, stages=stages,
                  device=dev)


class DistributedPublisher:
    """`WeightPublisher` for `weight_sync: distributed` (see the module docstring).

    `fallback`: the publisher used for a version whose broadcast failed `opts.attempts` times
    (a `DiskPublisher`; its weights are then loaded into the engines from RUN/weights/v<N>/), or
    None to raise `WeightSyncError` instead."""

    MODE, SENT = "distributed", "broadcast"   # the history's mode, the log's verb

    def __init__(self, mc: Any, control: Control, *, api_key: str | None, opts: SyncOptions,
                 fallback: Any | None = None, weights_dir: Path | None = None, attempt: int = 0,
                 host: str | None = None, roles: Callable[[], _Roles] = _megatron_roles,
                 export: Callable[[Any, torch.nn.Module, torch.dtype | None], Iterator[tuple[str, torch.Tensor]]]
                 | None = None):
        self.mc, self.control, self.api_key, self.opts = mc, control, api_key, opts
        self.fallback, self.attempt, self.host = fallback, attempt, host
        self.weights_dir = Path(weights_dir) if weights_dir is not None else control.run.weights_dir
        self._roles_fn, self._export = roles, export
        self._roles: _Roles | None = None
        self.sender: StageSender | None = None
        self.history: list[dict[str, Any]] = []   # one entry per publish (the leader's view)
        # --colocate's turn (trainer/colocate.py): the engines' KV cache is still released during the
        # publish, so they must stay paused after it; the colocation continues them once it is back
        # (a scheduler continued without it crashed at its next prefill, SGLang 0.5.14 on an H100)
        self.leave_paused = False

    # -- collective helpers ----------------------------------------------------------------
    def _agree(self, ok: bool) -> bool:
        """All ranks: True iff every rank's `ok` is True (also a barrier between phases)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return ok
        t = torch.tensor([1 if ok else 0], dtype=torch.int32, device=collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def _stream(self, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        if self._export is not None:
            return self._export(self.mc, model, self.opts.dtype)
        from rlslurm.convert import mcore_to_hf

        return mcore_to_hf(self.mc, model, dtype=self.opts.dtype)

    def _step(self, what: str, fn: Callable[[], Any], errors: list[str]) -> bool:
        try:
            fn()
            return True
        except Exception as e:  # every failure of a step means: tear down, retry or fall back
            errors.append(f"{what}: {e}")
            log.warning("weight sync: %s failed: %s", what, e)
            return False

    # -- publish ---------------------------------------------------------------------------
    def publish(self, model: torch.nn.Module, version: int) -> None:
        r = self._roles = self._roles or self._roles_fn()
        if self.sender is None:
            self.sender = self._new_sender(r)
        t0 = time.monotonic()
        errors: list[str] = []
        for i in range(1, self.opts.attempts + 1):
            t_try = time.monotonic()
            if self._attempt(model, version, r, errors):
                if r.coordinator:
                    self.control.set_weight_version(version)
                    self.control.clear_weight_update()
                    log.info("weights v%d %s to %d engine(s) in %.2f s (%d bytes, %d buckets)", version, self.SENT,
                             len(self.sender.engines.targets) if self.sender and self.sender.engines else 0,
                             time.monotonic() - t0, self.sender.last.bytes if self.sender else 0,
                             self.sender.last.buckets if self.sender else 0)
                self.history.append({"version": version, "mode": self.MODE, "tries": i,
                                     "seconds": time.monotonic() - t0, "errors": errors})
                return
            if self.sender is not None:
                self.sender.teardown()
            if r.coordinator:  # the bound each try keeps is checked against this line (tests/e2e)
                log.warning("weight sync v%d: try %d/%d failed after %.1f s (timeout %g s)", version, i,
                            self.opts.attempts, time.monotonic() - t_try, self.opts.timeout_s)
        self._fail(model, version, r, errors, t0)

    def _new_sender(self, r: _Roles) -> Any:
        """This rank's sender: the stage's leaders send, the other ranks only take part in the export."""
        if not r.leader:
            return None
        return StageSender(self.control, self.api_key, self.opts, stage=r.stage, attempt=self.attempt,
                           host=self.host, device=r.device)

    def _attempt(self, model: torch.nn.Module, version: int, r: _Roles, errors: list[str]) -> bool:
        o, s = self.opts, self.sender
        ok = True
        if r.coordinator:
            # Before any stage joins: an engine blocked joining a group answers /health no more than
            # one blocked in a broadcast, and the rollout nodes must not restart it for that.
            ok = self._step("marking the update", lambda: self.control.mark_weight_update(
                version, o.timeout_s * (r.stages + 5)), errors)
        ok = self._agree(ok)
        ok = self._join(r, ok, errors)
        if ok and r.coordinator:
            assert s is not None

            def prologue() -> None:
                assert s.engines is not None
                s.engines.call("pause_generation", mode=o.pause_mode, timeout=o.timeout_s)
                s.engines.call("begin_weight_update", timeout=o.timeout_s)
            ok = self._step("pause + begin_weight_update", prologue, errors)
        ok = self._agree(ok)
        ok = self._transfer(model, r, ok, errors)
        if ok and r.coordinator:
            assert s is not None and s.engines is not None

            def epilogue() -> None:
                assert s.engines is not None
                s.engines.call("end_weight_update", timeout=o.timeout_s)
                s.engines.call("update_weight_version", new_version=str(version), timeout=o.timeout_s)
                if not self.leave_paused:
                    s.engines.call("continue_generation", timeout=o.timeout_s)
            ok = self._step("end_weight_update + version + continue", epilogue, errors)
        return self._agree(ok)

    def _join(self, r: _Roles, ok: bool, errors: list[str]) -> bool:
        """Each stage's leader (re)builds its group with the engines."""
        s = self.sender
        # One stage's group at a time. An engine serves one /init_weights_update_group at a time and
        # blocks in it until every member has joined; stages joining at once could reach two engines
        # in opposite orders, each then waiting for the other inside a different group (seen in the
        # PP=2 test: both joins timed out).
        for stage in range(r.stages):
            if ok and r.leader and r.stage == stage:
                assert s is not None
                what = "joining engines" if r.stages == 1 else f"joining engines (stage {stage})"
                ok = self._step(what, s.ensure_group, errors)
            if r.stages > 1:
                ok = self._agree(ok)
        return ok

    def _transfer(self, model: torch.nn.Module, r: _Roles, ok: bool, errors: list[str]) -> bool:
        """Stage by stage, the exporters gather and the stage's leader broadcasts."""
        s = self.sender
        for stage in range(r.stages):
            if not ok:
                break
            if r.stage == stage and r.exporter:
                stream = self._stream(model)
                if r.leader:
                    assert s is not None
                    ok = self._step(f"sending stage {stage}", lambda: s.send(stream), errors)
                else:
                    for _ in stream:  # our part of each gather; the leader sends
                        pass
            ok = self._agree(ok)
        return ok

    def _fail(self, model: torch.nn.Module, version: int, r: _Roles, errors: list[str], t0: float) -> None:
        summary = "; ".join(errors) or "another rank failed"
        if self.fallback is None:
            if r.coordinator:
                self._release_engines(None, version)
            raise WeightSyncError(f"weight sync of version {version} failed {self.opts.attempts} time(s) within "
                                  f"{time.monotonic() - t0:.1f} s ({summary}); failing the step so that the job "
                                  "is requeued")
        if r.coordinator:
            log.error("WEIGHT SYNC FALLBACK: broadcast of version %d failed %d time(s) in %.1f s (%s); publishing "
                      "it to disk (%s) instead", version, self.opts.attempts, time.monotonic() - t0, summary,
                      self.weights_dir)
        self.fallback.publish(model, version)  # collective, like ours; records the version
        loaded = self._release_engines(self.weights_dir / f"v{version}", version) if r.coordinator else []
        if r.coordinator:
            log.warning("weight sync v%d: disk fallback done in %.1f s, loaded by %s", version,
                        time.monotonic() - t0, loaded)
        self.history.append({"version": version, "mode": "disk", "tries": self.opts.attempts,
                             "seconds": time.monotonic() - t0, "errors": errors, "loaded": loaded})

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


def bucket_plan(bucket: list[tuple[str, torch.Tensor]]) -> BucketPlan:
    """A one-dtype bucket's layout as flatten_bucket lays it out (rlslurm's receiver plan)."""
    entries, off = [], 0
    for name, t in bucket:
        entries.append((name, tuple(int(x) for x in t.shape), off))
        off += t.numel() * t.element_size()
    return BucketPlan(off, dtype_name(bucket[0][1].dtype), tuple(entries))


class _EmptyTensor:
    """Unpickles as `torch.Tensor()` (empty; one global, torch._tensor.Tensor). A pickled tensor names its storage loader, which megatron-core
    0.19 replaces in the trainer process (megatron.core.safe_globals.safe_load_from_bytes), and
    SGLang's SafeUnpickler refuses that module: on 2xH200 the engine's scheduler died on it."""

    def __reduce__(self):
        return (torch.Tensor, ())


def serialized_plan(name: str) -> str:
    """One TP rank's `serialized_named_tensors` entry: SGLang unpickles it (its SafeUnpickler allows
    torch.*) into [(name, tensor)]; the plan is the name, the tensor an empty placeholder."""
    import base64
    import pickle

    return base64.b64encode(pickle.dumps([(name, _EmptyTensor())])).decode()
