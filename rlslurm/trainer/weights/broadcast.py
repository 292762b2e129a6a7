"""Weight sync by broadcast (--weight-sync-transport broadcast): `broadcast_publisher`.

One weight-update group per pipeline stage: the trainer rank with DP=0, TP=0 (EP=0) of the stage
is rank 0 (the stage's *leader*), every engine rank follows (`rank_offset`), world size = engine
ranks + 1. The group is built by group.py `SyncGroup` (no sglang import, torchrun's default
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

The tries around this (the bracket, retries without unanswered engines, the disk fallback, the
record) are tries.py's, shared with the IPC transport: this module supplies `Broadcast`, the
transport's join and transfer, and `StageSender`, one stage leader's group and buckets. What no retry
heals: NCCL refuses a group with two ranks on one GPU, which `StageSender` checks before the engines
are asked to join (`WeightSyncSetupError`; docs/gpu.md, "Which GPU").

The HTTP side (engine targets, one call to every engine at once, releasing them after a failure)
is engines/fanout.py; this module is the torch.distributed side.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Literal

import torch

from rlslurm.buffer.control import Control, RendezvousRecord, RendezvousTaken
from rlslurm.engines.fanout import (
    REFUSED_TIMEOUT_S,
    Engines,
    EngineTarget,
    HttpLoop,
    dtype_name,
    engine_targets,
    refusing,
)
from rlslurm.engines.receiver import LOADER as RECEIVER_LOADER, BucketPlan, plan_payload
from rlslurm.gpus import torch_device_uuid
from rlslurm.net import free_port, node_ip
from rlslurm.settings.weight_plan import broadcast_backend, delivered_by
from rlslurm.trainer.weights.base import Roles, SyncOptions, WeightSyncError, WeightSyncSetupError, megatron_roles
from rlslurm.trainer.weights.buckets import SendStats, bucket_plan, serialized_plan
from rlslurm.trainer.weights.group import GroupSpec, NoEngines, SyncGroup, SyncGroupError, flatten_bucket, iter_buckets
from rlslurm.trainer.weights.tries import SyncPublisher

log = logging.getLogger("rlslurm.trainer.weight_sync")


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
        self.backend: Literal["gloo", "nccl"] = broadcast_backend(opts.backend, self.device.type)  # type: ignore[assignment]
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
        TP ranks wedged in it until the sync's timeout (docs/gpu.md, "Which GPU").
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


class Broadcast:
    """The broadcast transport (base.py `Transport`): one group per pipeline stage, led by the
    stage's leader; the other ranks take part in the export's gathers only. `host`: the address the
    groups' stores bind (default: this node's)."""

    sent = "broadcast"

    def __init__(self, *, host: str | None = None, roles: Callable[[], Roles] = megatron_roles):
        self.host, self._roles = host, roles

    def roles(self) -> Roles:
        return self._roles()

    def name(self, opts: SyncOptions, r: Roles) -> str:
        return delivered_by("broadcast", opts.backend, r.device.type)

    def new_sender(self, pub: SyncPublisher, r: Roles) -> StageSender | None:
        """This rank's sender: the stage's leaders send, the other ranks only take part in the export."""
        if not r.leader:
            return None
        return StageSender(pub.control, pub.api_key, pub.opts, stage=r.stage, attempt=pub.attempt,
                           host=self.host, device=r.device, ending=pub.ending)

    def join(self, pub: SyncPublisher, r: Roles, ok: bool, errors: list[str]) -> bool:
        """Each stage's leader (re)builds its group with the engines."""
        s = pub.sender
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
                    ok = pub.step(what, s.ensure_group, errors)
                except WeightSyncSetupError as e:
                    ok, refused = False, str(e)
            # collective: a refused group ends the sync on every rank at once
            refused = next((v for v in pub.gather(refused) if v), None)
            if refused is not None:
                if r.coordinator:
                    pub.control.clear_weight_update()
                raise WeightSyncSetupError(refused)
            if r.stages > 1:
                ok = pub.agree(ok)
        return ok

    def transfer(self, pub: SyncPublisher, model: torch.nn.Module, r: Roles, ok: bool, errors: list[str]) -> bool:
        """Stage by stage, the exporters gather and the stage's leader broadcasts."""
        s = pub.sender
        for stage in range(r.stages):
            if not ok:
                break
            if r.stage == stage and r.exporter:
                stream = pub.stream(model)
                if r.leader:
                    assert s is not None
                    ok = pub.step(f"sending stage {stage}", lambda: s.send(stream), errors)
                else:
                    for _ in stream:  # our part of each gather; the leader sends
                        pass
            ok = pub.agree(ok)
        return ok

    def refusal_detail(self, pub: SyncPublisher, r: Roles) -> str:
        """Each member's GPU, for the one-line error of a group NCCL refused."""
        if not isinstance(pub.sender, StageSender):
            return ""
        me = (f"trainer (stage {r.stage} leader)", torch_device_uuid(r.device.index or 0)
              if r.device.type == "cuda" else None)
        return f". GPUs: {gpu_map(me, pub.sender.current_targets())}"


def broadcast_publisher(mc: Any, control: Control, *, host: str | None = None,
                        roles: Callable[[], Roles] = megatron_roles, **kw: Any) -> SyncPublisher:
    """The publisher of --weight-sync-transport broadcast; `kw`: SyncPublisher's (api_key, opts,
    fallback, attempt, export, ending, note)."""
    return SyncPublisher(Broadcast(host=host, roles=roles), mc, control, **kw)
