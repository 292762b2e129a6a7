"""One rollout node's engines: which servers it runs, the router (node 0), supervision, and
what it publishes in RUN/control/.

Node k writes only its own record, `control/engines-node<k>.json`; node 0 merges every
node's record into `control/engines.json` (docs/shared-filesystem.md, "One writer per file").
The router runs on node 0; other nodes read its address from `control/router.json`, register
their own engines, and register them again if the router lost them (node 0 restarts a dead
router but re-registers only its own engines).

An engine larger than a node (`--rollout-num-gpus-per-engine` above the node's GPUs; on CPU any
value above 1, one rank per node) spans `nodes_per_engine` consecutive rollout nodes: the first of
them runs its node rank 0 as its one engine, the others follow it (engines/span.py) and
publish no engine of their own.

With broadcast weight sync every node runs an `UpdateWatcher`: no health check or restart while
the trainer's control/weight_update.json is active (an engine blocked in a broadcast answers
nothing), for at most --weight-sync-timeout-s plus a margin; past it a peer that never answers
is restarted like any hung engine; nodes > 0 read that record only when a health check fails. A
restarted engine holds the HF checkpoint (version 0): it stays out of the router until it serves the
published version (`weights_current`) — the trainer publishes again when it sees the restart
(trainer/main.py), the driver loads it in disk mode.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

from rlslurm.buffer.atomic import CorruptRecord, ensure_dir, listdir_fresh, write_json_atomic
from rlslurm.buffer.control import Control, EngineRecord, EnginesRecord, read_record
from rlslurm.buffer.rundir import RunDir
from rlslurm.engines.engine import EngineProcess, EngineSpec
from rlslurm.engines.memory_share import (
    TRAINER_BUILD_WAIT_S,
    MemoryPlan,
    serving_kv_bytes_per_token,
    serving_weights_bytes,
)
from rlslurm.engines.router import RouterError, RouterProcess
from rlslurm.engines.sglang_client import weight_version_sync
from rlslurm.engines.span import SpanFollower, SpanLeader, check_on_node
from rlslurm.engines.supervisor import EngineInfo, EngineSupervisor, RestartEvent, engine_records
from rlslurm.engines.turn_watch import TurnHold
from rlslurm.engines.update_watch import PAUSE_MARGIN_S, UpdateWatcher
from rlslurm.errors import ConfigError
from rlslurm.heartbeat import Beat
from rlslurm.net import engine_port_block, free_port, interface_ipv4
from rlslurm.rollout.router_context import parse_weight_version
from rlslurm.settings.argv import flag_value
from rlslurm.settings.config import RunConfig
from rlslurm.settings.weight_plan import WeightSyncPlan, weight_sync_plan

log = logging.getLogger(__name__)

ROUTER_WAIT_S = 900.0
START_TIMEOUT_S = 600.0  # an engine's start, to healthy (minutes on GPUs for a large model)
# Node 0 merges the other nodes' engine records into engines.json this often (its own engines'
# changes at once): each merge opens every node's record (docs/shared-fs-load.md). Another node's
# restart reaches the trainer up to this much later; the restarted engine awaits weights meanwhile
# and a dead one fails its sync's try like a late notice.
MERGE_S = 10.0
# Nodes > 0 learn that node 0 ended from its router: node 0 closes it on every way out (the run's end,
# a stop, a preempt, a crash), and they ask it for its workers at every poll (`node0_silent`).
# A router that stops answering makes them look for the run's end at once (rollout/main.py
# `until_end`), at most this often while it stays silent (node 0 restarting it, or node 0 dead: SLURM
# then ends the step, --kill-on-bad-exit). Their own looks can then be rare (docs/shared-fs-load.md).
NODE0_SILENT_LOOK_S = 10.0
# A node running another node's engine's rank (a span follower) has no router of its own to ask: it
# reads node 0's control/router.json this often until it finds one that answers.
ROUTER_FIND_S = 30.0
_NODE_FILE = re.compile(r"^engines-node(\d+)\.json$")
# Engines start with this version so that "no update yet" is the integer 0 (the HF checkpoint),
# and a restarted engine says 0 again: the driver's weight gate then sees it is behind.
WEIGHT_VERSION_ARGS = ("--weight-version", "0")


def receiver_args(plan: WeightSyncPlan) -> tuple[str, ...]:
    """--update-weight-receiver rlslurm, or weights by IPC (--colocate): the engine loads rlslurm's
    receiver (engines/receiver.py)."""
    if not plan.engine_loader:
        return ()
    from rlslurm.engines.receiver import LOADER

    return ("--custom-weight-loader", LOADER)


def quantization_args(plan: WeightSyncPlan, sglang_args: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """An FP8 --hf-checkpoint (`plan.fp8_block`): SGLang's --quantization fp8, said on the command line
    (SGLang would also read it off config.json), unless the passthrough says it (checked at submit:
    settings/low_precision.py `check_engine_quantization`); a key of --sglang-config counts as said."""
    from rlslurm.engines.sglang_args import read_passthrough

    sglang_args = read_passthrough(sglang_args).argv
    if plan.int4_group is not None:
        # an INT4 W4A16 --hf-checkpoint: SGLang's Marlin MoE, pinned, because it is the INT4 MoE form
        # SGLang can take a weight update into (its Triton form, Blackwell's auto default, keeps no way
        # back: docs/low-precision.md); other values are refused at submit (`check_int4_engine_args`)
        if flag_value(sglang_args, "--moe-runner-backend") is not None:
            return ()
        return ("--moe-runner-backend", "marlin")
    if plan.fp8_block is None or flag_value(sglang_args, "--quantization") is not None:
        return ()
    return ("--quantization", "fp8")


def colocate_args(cfg: RunConfig) -> tuple[str, ...]:
    """--colocate on GPUs: SGLang frees its weights and KV cache on /release_memory_occupation only
    through torch_memory_saver, which --enable-memory-saver turns on (on CPU it needs libcuda, and
    the release only flushes the cache: docs/sglang-behaviour.md)."""
    if not cfg.run.colocate or cfg.run.device != "cuda":
        return ()
    return ("--enable-memory-saver",)


def remote_code_args(cfg: RunConfig) -> tuple[str, ...]:
    """A checkpoint whose config class is remote code (MiMo: its config.json's auto_map names
    configuration_mimo.MiMoConfig): SGLang reads that config.json only with --trust-remote-code, which
    transformers needs for such a model_type, unless the passthrough says it already
    (docs/model-families.md, "MiMo-7B (`mimo`, MiMoForCausalLM)")."""
    from rlslurm.models.family import needs_remote_code

    if cfg.model.hf_checkpoint is None or flag_value(cfg.sglang_args, "--trust-remote-code") is not None:
        return ()
    try:
        model_type = json.loads((Path(cfg.model.hf_checkpoint) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return ()  # SGLang reports an unreadable checkpoint itself
    return ("--trust-remote-code",) if needs_remote_code(model_type) else ()


def nodes_per_engine(cfg: RunConfig) -> int:
    """How many rollout nodes one engine spans: 1 unless it has more ranks than a node holds (a
    node's rollout GPUs; on CPU one rank per node). resolve() checks that the ranks fill whole nodes."""
    tp = cfg.rollout.rollout_num_gpus_per_engine
    per_node = cfg.rollout_gpus_per_node if cfg.run.device == "cuda" else 1
    return 1 if tp <= per_node else tp // per_node


def span_bind_host(cfg: RunConfig) -> str | None:
    """Where an engine spanning nodes meets its ranks: --engine-span-interface's address on this node
    (engines/span.py), else None (the node's address)."""
    name = cfg.rollout.engine_span_interface
    if name is None or nodes_per_engine(cfg) < 2:
        return None
    return interface_ipv4(name, where="--engine-span-interface")


def engines_per_node(cfg: RunConfig) -> int:
    """Engines whose node rank 0 runs on one node (an engine spanning nodes: 1, on its first node)."""
    tp = cfg.rollout.rollout_num_gpus_per_engine
    if nodes_per_engine(cfg) > 1:
        return 1
    if cfg.run.device == "cuda":
        gpus = cfg.rollout_gpus_per_node
        if gpus < tp or gpus % tp:
            raise ConfigError(f"{cfg.gpu_split_flags[1]} {gpus} is not a multiple of "
                              f"--rollout-num-gpus-per-engine {tp}")
        return gpus // tp
    return cfg.rollout.engines_per_node or 1


def engines_total(cfg: RunConfig) -> int:
    return (cfg.slurm.rollout_nodes or 1) // nodes_per_engine(cfg) * engines_per_node(cfg)


def engine_specs(cfg: RunConfig, *, node: int, host: str, api_key: str, log_dir: Path,
                 ncpu: int | None = None) -> list[EngineSpec]:
    """This node's SGLang servers. cuda: rollout_gpus_per_node / rollout_num_gpus_per_engine
    engines on consecutive GPUs; cpu: engines_per_node engines, one pinned core each. An engine
    spanning nodes: this node's rank of it, named after its first node (engines/span.py)."""
    if cfg.model.hf_checkpoint is None:
        raise ConfigError("--hf-checkpoint is required: the SGLang servers load it")
    check_engine_modules(cfg)
    tp = cfg.rollout.rollout_num_gpus_per_engine
    ncpu = ncpu or os.cpu_count() or 1
    cuda = cfg.run.device == "cuda"
    plan = weight_sync_plan(cfg)
    # what every engine of the run shares
    common = dict(model_path=str(cfg.model.hf_checkpoint), host=host, api_key=api_key,
                  dtype=cfg.rollout.rollout_dtype or "auto", device=cfg.run.device,
                  # rlslurm/stacks.py: --allow-untested-stack covers the rollout's SGLang too
                  allow_untested_sglang=cfg.rollout.allow_untested_sglang or cfg.run.allow_untested_stack,
                  extra_args=(*cfg.sglang_args, *WEIGHT_VERSION_ARGS, *receiver_args(plan),
                              *quantization_args(plan, cfg.sglang_args), *colocate_args(cfg),
                              *remote_code_args(cfg)))
    span = nodes_per_engine(cfg)
    # the passthrough judged by this node's own SGLang, its --config file as it is now (engines/span.py)
    check_on_node(cfg.sglang_args, span, cfg.rollout.engine_span_interface, cfg.rollout.engine_span_ports_closed)
    if span > 1:
        first, rank = node - node % span, node % span
        name = f"engine-{first}-0"
        p = engine_port_block(host, 1)[0]
        return [EngineSpec(
            name=name, port=p.port, nccl_port=p.nccl_port, tp_size=tp, nnodes=span, node_rank=rank,
            log_path=log_dir / (f"{name}.log" if rank == 0 else f"{name}-rank{rank}.log"),
            cpu_core=None if cuda else node % ncpu, **common)]
    n = engines_per_node(cfg)
    return [EngineSpec(
        name=f"engine-{node}-{i}", port=p.port, nccl_port=p.nccl_port, log_path=log_dir / f"engine-{node}-{i}.log",
        base_gpu_id=i * tp if cuda else 0, tp_size=tp if cuda else 1,
        # numbered across nodes: harmless on separate hosts, and virtual nodes sharing one host
        # (the test cluster) do not stack every node's engine 0 on core 0
        cpu_core=None if cuda else (node * n + i) % ncpu, **common,
    ) for i, p in enumerate(engine_port_block(host, n))]


def check_engine_modules(cfg: RunConfig) -> None:
    """A module this node's engines need for the run's model and that this environment lacks: one line,
    before any engine starts (engines/dsa_deps.py: GLM-5's indexer on CUDA needs deep_gemm)."""
    from rlslurm.engines.dsa_deps import applies, dsa_engine_refusal
    from rlslurm.engines.sglang_versions import installed_sglang_version

    version = installed_sglang_version()
    if not applies(cfg.run.device, version):
        return  # the model config is read (from config.json without --model) only where it can matter
    from rlslurm.errors import UserError
    from rlslurm.models.model_from_hf import run_model

    try:
        mc = run_model(cfg.model.model, cfg.model.hf_checkpoint)
    except UserError:  # the trainer, building the same config from the same file, names that (trainer/setup.py)
        return
    if (why := dsa_engine_refusal(mc, "cuda", version)) is not None:
        raise ConfigError(why)


def weights_current(control: Control, api_key: str):
    """The supervisor's `admit`: does this (restarted) engine serve the version the trainer last
    published? Engines of a fresh run, or before any publish, are always current (version 0)."""
    def admit(proc: EngineProcess) -> bool:
        rec = control.weight_version()
        if rec is None or rec.version == 0:
            return True
        have = parse_weight_version(weight_version_sync(proc.url, api_key), where=f"{proc.url}/model_info")
        return have >= rec.version

    return admit


class RemoteRouter(RouterProcess):
    """Node 0's router seen from another node: same worker API, no process. `is_alive` is
    True so this node's supervisor never starts a router of its own."""

    @classmethod
    def at(cls, url: str, *, api_key: str | None, log_path: Path) -> "RemoteRouter":
        u = urlsplit(url)
        if u.hostname is None or u.port is None:
            raise ConfigError(f"control/router.json: router url {url!r} has no host:port")
        return cls(host=u.hostname, port=u.port, log_path=log_path, api_key=api_key)

    def start(self, *, timeout: float = 60.0) -> None:
        return None

    def is_alive(self) -> bool:
        return True

    def kill(self, *, timeout: float = 30.0) -> None:
        return None


class RolloutNode:
    """Starts this node's engines (and on node 0 the router), keeps the control files
    current, and kills everything it started on `close()`."""

    def __init__(self, cfg: RunConfig, run: RunDir, *, node: int, node_name: str, host: str, attempt: int):
        self.cfg, self.run, self.node, self.node_name, self.host = cfg, run, node, node_name, host
        self.attempt = attempt
        # the weight-sync settings, as the trainer reads them (rlslurm/settings/weight_plan.py)
        self.plan = weight_sync_plan(cfg)
        self.control = Control(run)
        self.api_key = run.ensure_api_key()
        self.log_dir = run.attempt_log_dir(attempt)
        self.router: RouterProcess | None = None
        self.supervisor: EngineSupervisor | None = None
        self.follower: SpanFollower | None = None   # this node runs another node's engine's rank
        self.watcher: UpdateWatcher | None = None
        self.restart_events: list[RestartEvent] = []
        self.phase, self.phase_since = "starting engines", time.time()
        self.phase_of: Callable[[], str] | None = None  # node 0: the driver's phase once it runs
        self._merged_at = -MERGE_S  # node 0: engines.json's last merge (monotonic)
        self._merged: list[EngineRecord] | None = None  # node 0: what engines.json holds (it writes it)
        self._silent_look_at = -NODE0_SILENT_LOOK_S  # nodes > 0: the last look node 0's silence asked for
        self._router_find_at = -ROUTER_FIND_S  # span followers: the last read of router.json
        self._heartbeat = Beat(lambda: self.control.heartbeat("rollout", self.node, phase=self.phase,
                                                              phase_since=self.phase_since))

    @property
    def node_file(self) -> Path:
        return self.control.dir / f"engines-node{self.node}.json"

    def start(self, *, cancel=lambda: False) -> None:
        self._heartbeat(now=True)  # "starting engines" from now: minutes on GPUs, with no heartbeat until they are up
        specs = engine_specs(self.cfg, node=self.node, host=self.host, api_key=self.api_key, log_dir=self.log_dir)
        if self.cfg.shares_gpus:
            specs = self._after_trainer_offload(specs)
        if specs[0].node_rank > 0:
            self._publish([])  # no engine of its own: clears what an earlier attempt's layout left
            self.follower = SpanFollower(specs[0], self.control, attempt=self.attempt, node_name=self.node_name).start()
            return
        # The engines are spawned first and the router is waited for only once they are healthy:
        # SGLang's start-up is the long pole (minutes on GPUs, ~30 s on CPU), the router's or the
        # wait for node 0's router then costs nothing at a requeue.
        if self.node == 0:
            self.router = RouterProcess(host=self.host, port=free_port(self.host), log_path=self.log_dir / "router.log",
                                        api_key=self.api_key, extra_args=tuple(self.cfg.router_args),
                                        health_check_interval_s=max(1, int(self.cfg.rollout.engine_health_interval_s)))
            self.router.spawn()
        interval = self.cfg.rollout.engine_health_interval_s
        # colocated, an engine's start includes its wait for the trainer's model build (engines/memory_share.py)
        start_s = START_TIMEOUT_S + (TRAINER_BUILD_WAIT_S if self.cfg.shares_gpus else 0.0)
        self.supervisor = EngineSupervisor(specs, self.router, health_interval_s=interval, start_timeout_s=start_s,
                                           health_timeout_s=max(5.0, interval), on_change=self._publish,
                                           on_restart=self._on_restart,
                                           admit=weights_current(self.control, self.api_key),
                                           span=SpanLeader(self.control, attempt=self.attempt,
                                                           bind_host=span_bind_host(self.cfg)),
                                           hold_restart=self._turn_hold())
        self.supervisor.start(router_ready=lambda: self._router_ready(cancel))
        if not self.plan.by_disk:
            # nodes > 0 read the bracket only when a check fails (covers): engines/update_watch.py
            self.watcher = UpdateWatcher(self.control, self.supervisor, look=self.node == 0,
                                         cap_s=self.plan.timeout_s + PAUSE_MARGIN_S).start()
            self.supervisor.in_update = self.watcher.covers

    def _after_trainer_offload(self, specs: list[EngineSpec]) -> list[EngineSpec]:
        """--colocate (or --shared-gpu): each engine's process waits, once SGLang is imported, until this
        attempt's trainer has built its model and moved its state off the GPUs (its ColocationMemory
        record), then sizes its share on what the trainer leaves (engines/memory_share.py). The import
        overlaps the trainer's build."""
        from rlslurm.models.model_from_hf import run_model

        mc = run_model(self.cfg.model.model, self.cfg.model.hf_checkpoint) if self.cfg.run.device == "cuda" else None
        return [dataclasses.replace(spec, memory=MemoryPlan(
            record=str(self.control.colocation_memory_file), attempt=self.attempt,
            weights_bytes=serving_weights_bytes(self.cfg, mc) // spec.tp_size if mc else 0,
            kv_bytes_per_token=serving_kv_bytes_per_token(self.cfg, mc, spec.tp_size) if mc else 0))
                for spec in specs]

    def _turn_hold(self) -> TurnHold | None:
        """--colocate: restarts wait for the trainer's turn to end (engines/turn_watch.py), for at most
        the turn's own bound (each engine call of the turn: --weight-sync-timeout-s) plus a margin."""
        if not self.cfg.run.colocate:
            return None
        return TurnHold(self.control, cap_s=self.plan.timeout_s + PAUSE_MARGIN_S)

    def _router_ready(self, cancel) -> RouterProcess:
        if self.node == 0:
            self.router.wait_ready()
            self.control.write_router(self.router.url)
        else:
            self.router = self._remote_router(cancel)
        return self.router

    def _remote_router(self, cancel) -> RemoteRouter:
        deadline = time.monotonic() + ROUTER_WAIT_S
        while True:
            rec = self.control.router()
            if rec is not None:
                router = RemoteRouter.at(rec.url, api_key=self.api_key, log_path=self.log_dir / "router.log")
                try:
                    router.workers()  # a record left by a previous attempt points at nothing
                    return router
                except RouterError:
                    router._http.close()
            if cancel() or time.monotonic() > deadline:
                raise RouterError(f"{self.control.dir}/router.json: no live router after {ROUTER_WAIT_S:g} s "
                                  "(is rollout node 0 running?)")
            time.sleep(1.0)

    def _on_restart(self, ev: RestartEvent) -> None:
        self.restart_events.append(ev)

    def _publish(self, infos: list[EngineInfo]) -> None:
        ensure_dir(self.control.dir)
        rec = EnginesRecord(engines=engine_records(infos, self.node_name, self.control))
        write_json_atomic(self.node_file, rec.model_dump(mode="json"))
        if self.node == 0:
            self.merge_engines()

    def merge_engines(self, *, due: bool = True) -> None:
        """Node 0: every node's engines into control/engines.json (the file the trainer reads). Not
        `due`: only if MERGE_S passed since the last merge (this node's own engines' changes merge at
        once, `_publish`); each merge reads every node's record: ~4 metadata operations per rollout
        node, docs/shared-fs-load.md."""
        now = time.monotonic()
        if not due and now - self._merged_at < MERGE_S:
            return
        self._merged_at = now
        engines: list[EngineRecord] = []
        for name in sorted(listdir_fresh(self.control.dir), key=lambda n: (len(n), n)):
            if _NODE_FILE.match(name):
                # just listed: not listed again per record (docs/shared-fs-load.md); damaged: the attempt fails
                rec = read_record(self.control.dir / name, EnginesRecord, relist=False)
                if rec is not None:
                    engines += rec.engines
        current = self._merged
        if current is None:  # this attempt's first merge: what an earlier attempt left
            try:
                current = self.control.engines()
            except CorruptRecord as e:  # this node writes it: rebuild it from the node records
                log.warning("%s; rewriting it", e)
        if engines != current:
            self.control.write_engines(engines)
        self._merged = engines

    def _engines(self) -> list[EngineRecord]:
        """engines.json: node 0 (its only writer) answers from what it last wrote, not a read of the
        shared run dir per call (the driver asks every 0.5 s while it waits for weights)."""
        return self._merged if self._merged is not None else self.control.engines()

    def ensure_registered(self, known: set[str]) -> None:
        """Nodes > 0: add back engines the router does not know (`known`: its workers' urls; after a
        router restart)."""
        if self.supervisor is None or self.router is None or self.node == 0:
            return
        for info in self.supervisor.engines():
            if info.healthy and not info.awaiting_weights and info.url not in known:
                log.warning("%s missing from the router: registering it again", info.name)
                try:
                    self.router.add_worker(info.url, self.api_key)
                except RouterError as e:
                    log.warning("re-registering %s failed: %s", info.name, e)

    def node0_silent(self) -> bool:
        """Nodes > 0, every poll: ask node 0's router for its workers (and register this node's engines
        it lost again). True when it does not answer, at most every NODE0_SILENT_LOOK_S: then the
        caller looks for the run's end (NODE0_SILENT_LOOK_S has the why)."""
        router = self.router if self.router is not None else self._find_router()
        if router is None:
            return False
        try:
            known = {w.get("url") for w in router.workers()}
        except RouterError as e:
            if self.follower is not None:  # perhaps an earlier attempt's router.json: read it again later
                router.close()
                self.router = None
            now = time.monotonic()
            if now - self._silent_look_at < NODE0_SILENT_LOOK_S:
                return False
            self._silent_look_at = now
            log.warning("router unreachable: %s; looking for the run's end", e)
            return True
        self.ensure_registered(known)
        return False

    def _find_router(self) -> RemoteRouter | None:
        """A span follower's view of node 0's router, from control/router.json (read at most every
        ROUTER_FIND_S); None before node 0 wrote it, and on nodes whose router comes from start()."""
        now = time.monotonic()
        if self.follower is None or now - self._router_find_at < ROUTER_FIND_S:
            return None
        self._router_find_at = now
        rec = self.control.router()
        if rec is not None:
            self.router = RemoteRouter.at(rec.url, api_key=self.api_key, log_path=self.log_dir / "router.log")
        return self.router

    def housekeeping(self) -> bool:
        """Every poll of the rollout process. Raises EngineFailure once an engine or the router is
        past its restart budget (engines/supervisor.py): the attempt then ends as a failure. True (nodes
        > 0): node 0's router stopped answering, look for the run's end now (`node0_silent`)."""
        if self.supervisor is not None:
            self.supervisor.raise_if_failed()
        self._beat()
        if self.node == 0:
            self.merge_engines(due=False)
            return False
        return self.node0_silent()

    def _beat(self) -> None:
        """This node's heartbeat with its phase: starting engines, then serving (node 0: what the
        driver does); `phase_since` moves only when the phase changes. Written every HEARTBEAT_S and
        at each change of phase, not at every housekeeping poll (rlslurm/heartbeat.py)."""
        phase = self.phase_of() if self.phase_of is not None else (
            "starting engines" if self.supervisor is None and self.follower is None else "serving")
        changed = phase != self.phase
        if changed:
            self.phase, self.phase_since = phase, time.time()
        self._heartbeat(now=changed)

    def wait_for_all_nodes(self, *, timeout: float, cancel=lambda: False) -> bool:
        """Node 0, before the first rollout: wait until every rollout node's engines are healthy
        in engines.json. A rollout started on some of them would leave the late ones out of the
        first weight sync and have them serve the checkpoint's weights until the next. Bounded:
        past `timeout` the run goes on with what is up (a node that never comes is the
        supervisor's and SLURM's business, not a reason to stall)."""
        want = engines_total(self.cfg)
        deadline = time.monotonic() + timeout
        while not cancel():
            self.merge_engines()
            up = [e for e in self._engines() if e.healthy]
            if len(up) >= want:
                return True
            if time.monotonic() > deadline:
                log.warning("%d of %d engines healthy after %.0f s: starting without the others",
                            len(up), want, timeout)
                return False
            time.sleep(1.0)
        return False

    def describe(self) -> str:
        if self.follower is not None:
            return f"node rank {self.follower.spec.node_rank} of {self.follower.spec.name}"
        return f"{len(self.supervisor.urls) if self.supervisor else 0} engine(s)"

    def engine_urls(self) -> list[str]:
        urls = [e.url for e in self._engines()]
        return urls or (self.supervisor.urls if self.supervisor else [])

    def restarts_total(self) -> int:
        return sum(e.restarts for e in self._engines())

    def recovering(self) -> bool:
        """This node's supervisor is restarting its router or an engine (EngineSupervisor.recovering)."""
        return self.supervisor is not None and self.supervisor.recovering()

    def close(self) -> None:
        """Kill every process this node started; always safe to call."""
        try:
            if self.watcher is not None:
                self.watcher.close()
            if self.follower is not None:
                self.follower.close()
            if self.supervisor is not None:
                self.supervisor.close()
        finally:
            if self.router is not None:
                self.router.close()
