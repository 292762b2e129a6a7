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
    stage s, in turn the exporters (DP=0, and the DP ranks the expert gathers reach) export
                     (gathered over TP/ETP/EP, HF names, `mcore_to_hf`);
                     the leader packs buckets of `bucket_bytes` and for each bucket sends
                     /update_weights_from_distributed (names/dtypes/shapes) to every engine
                     at once while broadcasting the bucket's tensors
    stage-0 leader   /end_weight_update, /update_weight_version, /continue_generation;
                     Control.set_weight_version(version); Control.clear_weight_update()

Ranks agree on success after each phase (an all-reduce over the default group), so a failure on
one leader is seen by every rank at the same point. Every HTTP call and collective is bounded by
`timeout_s`. A failed attempt tears the group down (the engines' pending receives fail once our
connections close) and the next attempt rebuilds it, without the engines that did not answer the
failed one (their supervisors check them once the bracket is closed, and restart a wedged one); after
`attempts` failed attempts the version is published by the fallback (--weight-sync-fallback disk:
`DiskPublisher` writes weights/v<N>/, the stage-0 leader loads it into every engine that answers),
or with no fallback `WeightSyncError` is raised: the attempt fails and SLURM requeues it. What a
retry cannot heal ends the attempt at once as a user error (`WeightSyncSetupError`: NCCL refuses a
group with two ranks on one GPU, checked before the engines are asked to join: issue 30). A stop,
preempt or TERM interrupts a sync in flight (`SyncInterrupted`). Every publish returns a
`Delivered` (trainer/delivery.py) naming the transport that delivered it. It never waits without a bound.

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
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal

import torch
import torch.distributed as dist

from rlslurm.buffer.control import Control, RendezvousRecord, RendezvousTaken
from rlslurm.engines.fanout import (
    REFUSED_TIMEOUT_S,
    Cancelled,
    Engines,
    EngineTarget,
    HttpLoop,
    Unanswered,
    dtype_name,
    engine_targets,
    refusing,
    release,
)
from rlslurm.engines.receiver import LOADER as RECEIVER_LOADER
from rlslurm.engines.receiver import BucketPlan, plan_payload
from rlslurm.errors import ConfigError, UserError
from rlslurm.gpus import torch_device_uuid
from rlslurm.net import free_port, node_ip
from rlslurm.trainer.collectives import collective_device
from rlslurm.trainer.delivery import ERROR_CHARS, Delivered
from rlslurm.trainer.sync_group import (
    GroupSpec,
    NoEngines,
    SyncCancelled,
    SyncGroup,
    SyncGroupError,
    flatten_bucket,
    iter_buckets,
)

log = logging.getLogger("rlslurm.trainer.weight_sync")


class WeightSyncError(RuntimeError):
    """A weight sync failed after every try and there is no fallback (--weight-sync-fallback off):
    the attempt fails and SLURM requeues it within --max-failures."""


class WeightSyncSetupError(UserError):
    """The weight-sync group cannot be built on this layout (NCCL refuses two ranks on one GPU):
    a retry, the fallback or a requeue would meet the same GPUs, so the job ends with the reason."""


class SyncInterrupted(RuntimeError):
    """The job is ending (a stop, a preempt request, a TERM) while a sync was in flight: the sync is
    abandoned on every rank and the trainer checkpoints (the next attempt publishes the version)."""


# NCCL's words for a group it refuses to build (ncclInvalidUsage), e.g. "Duplicate GPU detected :
# rank 0 and rank 1 both on CUDA device 60" (issue 30): tried again it fails the same way.
SETUP_REFUSALS = ("Duplicate GPU detected", "ncclInvalidUsage", "invalid usage")


def setup_refusal(errors: list[str]) -> str | None:
    return next((e for e in errors if any(w in e for w in SETUP_REFUSALS)), None)


def gpu_clashes(trainer: tuple[str, str | None], targets: list[EngineTarget]) -> list[str]:
    """The GPUs two members of one weight-sync group would share: `trainer` is (who, uuid); an engine's
    TP ranks are its `gpus`. Unknown identities (None, ()) say nothing."""
    members = [trainer] + [(f"engine {t.url} TP rank {j}", g) for t in targets for j, g in enumerate(t.gpus)]
    seen: dict[str, str] = {}
    out = []
    for who, gpu in members:
        if gpu is None:
            continue
        if gpu in seen:
            out.append(f"{seen[gpu]} and {who} are both on {gpu}")
        else:
            seen[gpu] = who
    return out


def gpu_map(trainer: tuple[str, str | None], targets: list[EngineTarget]) -> str:
    """Each member's GPU, for a one-line error."""
    parts = [f"{trainer[0]}: {trainer[1] or 'unknown'}"]
    parts += [f"{t.url}: {', '.join(t.gpus) or 'unknown'}" for t in targets]
    return "; ".join(parts)



@contextmanager
def _cancelled_on_error(futs: list, errors: type[BaseException]) -> Iterator[None]:
    """The engines' update calls of a send are cancelled when the send fails: they wait for bytes that
    will not come (the group is torn down with the attempt)."""
    try:
        yield
    except errors:
        for f in futs:
            f.cancel()
        raise

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


def backend_for(opts: SyncOptions, device: torch.device) -> Literal["gloo", "nccl"]:
    """The weight-sync group's backend: the configured one, else NCCL from a CUDA trainer."""
    return opts.backend or ("nccl" if device.type == "cuda" else "gloo")


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
                 attempt: int = 0, host: str | None = None, device: torch.device | None = None,
                 ending: Callable[[], bool] | None = None):
        self.control, self.api_key, self.opts = control, api_key, opts
        self.stage, self.attempt = stage, attempt
        self.host = host or node_ip()
        self.device = device or torch.device("cpu")
        self.backend: Literal["gloo", "nccl"] = backend_for(opts, self.device)
        self.ending = ending
        self._loop = HttpLoop()
        self.engines: Engines | None = None
        self.group: SyncGroup | None = None
        self._builds = 0
        self.last = SendStats()
        # engine processes (url, pid, restarts) that did not answer a failed try: left out of the next
        # tries (a wedged one would hold each for the whole timeout) until their supervisor restarts them
        self.unanswered: set[tuple[str, int | None, int]] = set()
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
        self.unanswered &= {t.identity for t in targets}  # a restarted engine is another process
        hung = [t.url for t in targets if t.identity in self.unanswered]
        if hung:
            log.warning("weight sync: leaving out %s (did not answer the last try; its supervisor checks it now "
                        "that the update bracket is closed, and a later sync includes it again once restarted)", hung)
            targets = [t for t in targets if t.identity not in self.unanswered]
        if not targets:
            raise NoEngines(f"{self.control.dir}/engines.json lists no healthy engine to send weights to"
                                 + (f" ({len(gone)} refused connections)" if gone else ""))
        if self.group is not None and self.engines is not None and self.engines.targets == targets:
            return
        self.teardown()
        self._build(targets)

    def _check_gpus(self, targets: list[EngineTarget]) -> None:
        """NCCL refuses a group with two ranks on one GPU, and a refused group can leave an engine's
        TP ranks wedged in it (issue 30: a TP2 engine beside the trainer on GPU 0 hung for 300 s).
        Refuse it here, before any engine is asked to join."""
        if self.backend != "nccl" or self.device.type != "cuda":
            return
        me = (f"trainer (stage {self.stage} leader)", torch_device_uuid(self.device.index or 0))
        clashes = gpu_clashes(me, targets)
        if clashes:
            raise WeightSyncSetupError(
                f"weight sync over NCCL: {'; '.join(clashes)}, and NCCL refuses two ranks of one group on one GPU. "
                f"GPUs: {gpu_map(me, targets)}. Give the engines GPUs of their own (docs/gpu.md, 'Which GPU'), or "
                "share them on purpose with --colocate (rlslurm run: --shared-gpu)")

    def _build(self, targets: list[EngineTarget]) -> None:
        o = self.opts
        self._check_gpus(targets)
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
        engines = Engines(self._loop, targets, self.api_key, cancel=self.ending)
        offsets = [1 + sum(t.ranks for t in targets[:i]) for i in range(len(targets))]
        t0 = time.monotonic()
        futs = engines.submit("init_weights_update_group", lambda i: {"rank_offset": offsets[i]},
                              master_address=group.spec.master_addr, master_port=group.spec.master_port,
                              world_size=world, group_name=name, backend=self.backend, timeout=o.timeout_s)
        try:
            group.join(cancel=self.ending)
            engines.wait(futs, o.timeout_s, "init_weights_update_group")
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
            live = [t for t in engines.targets if t.identity not in self.unanswered]  # a hung one: no 10 s each
            if group is not None and live:
                alive = Engines(self._loop, live, self.api_key)
                alive.best_effort("destroy_weights_update_group", group_name=group.spec.group_name)
                alive.close()
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
        with _cancelled_on_error(futs, BaseException):
            for k, bucket in enumerate(iter_buckets(it, self.opts.bucket_bytes, self.device, one_dtype=True)):
                if k >= len(plan) or bucket_plan(bucket) != plan[k]:
                    # the engines wait for the planned bytes: fail this attempt (its group is torn down)
                    raise SyncGroupError(f"weight sync: bucket {k} differs from the plan sent to the engines")
                flat = flatten_bucket([t for _, t in bucket])
                if len(in_flight) == 2:
                    self.group.finish(in_flight.pop(0)[1], cancel=self.ending)
                in_flight.append((flat, self.group.start([flat])))
                stats.count(bucket)
            for _, works in in_flight:
                self.group.finish(works, cancel=self.ending)
        self.engines.wait(futs, to, "update_weights_from_tensor")

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
        with _cancelled_on_error(futs, SyncGroupError):
            self.group.broadcast(tensors, cancel=self.ending)
        self.engines.wait(futs, to, "update_weights_from_distributed")
        stats.count(bucket)

    def close(self) -> None:
        self.teardown()
        self._loop.close()


# --- the publisher ------------------------------------------------------------------------

@dataclass
class _Roles:
    exporter: bool     # takes part in the export's gathers (convert/parallel.py export_roles)
    leader: bool       # rank 0 of its stage's group
    coordinator: bool  # the stage-0 leader: brackets the update, records the version
    stage: int
    stages: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


def _megatron_roles() -> _Roles:
    from megatron.core import parallel_state as ps

    from rlslurm.convert.parallel import export_roles

    roles = export_roles()  # the export's gathers decide who exports (convert/export.py)
    stage, stages = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return _Roles(exporter=roles.exporter, leader=roles.sender, coordinator=roles.sender and stage == 0,
                  stage=stage, stages=stages, device=dev)


class DistributedPublisher:
    """`WeightPublisher` for `weight_sync: distributed` (see the module docstring).

    `fallback`: the publisher used for a version whose broadcast failed `opts.attempts` times
    (a `DiskPublisher`; its weights are then loaded into the engines from RUN/weights/v<N>/), or
    None to raise `WeightSyncError` instead. `ending`: true once the job ends (a stop, a preempt, a
    TERM; checked by the leaders while they wait): the sync in flight is given up. `note`: told what
    the publish is doing ("weight sync v3 (nccl): try 2/2"), for the trainer's phase record."""

    SENT = "broadcast"   # the log's verb

    def __init__(self, mc: Any, control: Control, *, api_key: str | None, opts: SyncOptions,
                 fallback: Any | None = None, weights_dir: Path | None = None, attempt: int = 0,
                 host: str | None = None, roles: Callable[[], _Roles] = _megatron_roles,
                 export: Callable[[Any, torch.nn.Module, torch.dtype | None], Iterator[tuple[str, torch.Tensor]]]
                 | None = None, ending: Callable[[], bool] | None = None,
                 note: Callable[[str], None] | None = None):
        self.mc, self.control, self.api_key, self.opts = mc, control, api_key, opts
        self.fallback, self.attempt, self.host = fallback, attempt, host
        self.weights_dir = Path(weights_dir) if weights_dir is not None else control.run.weights_dir
        self._roles_fn, self._export = roles, export
        self.ending, self._note = ending, note
        self._roles: _Roles | None = None
        self.sender: StageSender | None = None
        self.deliveries: list[Delivered] = []   # one per publish (every rank's view of the agreed outcome)
        self.fallbacks = 0                       # versions the disk fallback delivered in this attempt
        self._interrupted = False                # this rank gave up a wait: the job is ending
        self._no_engines = False                 # this rank found no engine to send to
        # --colocate's turn (trainer/colocate.py): the engines' KV cache is still released during the
        # publish, so they must stay paused after it; the colocation continues them once it is back
        # (a scheduler continued without it crashed at its next prefill, SGLang 0.5.14 on an H100)
        self.leave_paused = False

    def transport(self, r: _Roles) -> str:
        """What delivers a version when the tries succeed (trainer/delivery.py TRANSPORTS)."""
        return backend_for(self.opts, r.device)

    # -- collective helpers ----------------------------------------------------------------
    def _agree(self, ok: bool) -> bool:
        """All ranks: True iff every rank's `ok` is True (also a barrier between phases)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return ok
        t = torch.tensor([1 if ok else 0], dtype=torch.int32, device=collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def _gather(self, obj: Any) -> list[Any]:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return [obj]
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    def _stream(self, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        if self._export is not None:
            return self._export(self.mc, model, self.opts.dtype)
        from rlslurm.convert import mcore_to_hf

        return mcore_to_hf(self.mc, model, dtype=self.opts.dtype)

    def _step(self, what: str, fn: Callable[[], Any], errors: list[str]) -> bool:
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
        r = self._roles = self._roles or self._roles_fn()
        if self.sender is None:
            self.sender = self._new_sender(r)
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
                             self.SENT, len(self.sender.engines.targets) if self.sender and self.sender.engines else 0,
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

    def _after_failed_try(self, version: int, r: _Roles, errors: list[str]) -> bool:
        """Collective, after a failed try: what no retry heals ends the sync here on every rank (a group
        NCCL refused: `WeightSyncSetupError`; the job ending: `SyncInterrupted`). The bracket is closed
        until the next try, so that the rollout nodes' health checks find a wedged engine. True: there
        was no engine to send to (`NoEngines`)."""
        refused = setup_refusal(errors)
        if refused is not None and self.sender is not None and isinstance(self.sender, StageSender):
            targets = self.sender.current_targets()
            me = (f"trainer (stage {r.stage} leader)", torch_device_uuid(r.device.index or 0)
                  if r.device.type == "cuda" else None)
            refused = f"{refused}. GPUs: {gpu_map(me, targets)}"
        ending = self._interrupted or (r.coordinator and self.ending is not None and self.ending())
        verdicts = self._gather((refused, ending, self._no_engines))
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

    def _new_sender(self, r: _Roles) -> Any:
        """This rank's sender: the stage's leaders send, the other ranks only take part in the export."""
        if not r.leader:
            return None
        return StageSender(self.control, self.api_key, self.opts, stage=r.stage, attempt=self.attempt,
                           host=self.host, device=r.device, ending=self.ending)

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
            refused: str | None = None
            if ok and r.leader and r.stage == stage:
                assert s is not None
                what = "joining engines" if r.stages == 1 else f"joining engines (stage {stage})"
                try:
                    ok = self._step(what, s.ensure_group, errors)
                except WeightSyncSetupError as e:
                    ok, refused = False, str(e)
            # collective: a refused group ends the sync on every rank at once
            refused = next((v for v in self._gather(refused) if v), None)
            if refused is not None:
                if r.coordinator:
                    self.control.clear_weight_update()
                raise WeightSyncSetupError(refused)
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

    def _fail(self, model: torch.nn.Module, version: int, r: _Roles, errors: list[str], t0: float) -> Delivered:
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
