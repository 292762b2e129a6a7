"""One SGLang engine over several nodes (`--rollout-num-gpus-per-engine` larger than a rollout
node's GPUs; on CPU, one rank per node).

SGLang runs such an engine as one process per node (`--nnodes N --node-rank r --dist-init-addr
HOST:PORT`, the address of node rank 0): node rank 0 serves the HTTP API, the others only a
dummy health port that answers 200 whatever their scheduler does (docs/sglang-behaviour.md, "One
engine over several nodes"). rlslurm runs the ranks as one unit:

- node rank 0 is an ordinary engine of its node's supervisor (engines/supervisor.py): registered
  with the router once, health-checked, restarted within its budget. Before each of its starts
  the supervisor calls `SpanLeader.prepare`, which picks a fresh dist-init address on rank 0's
  host and writes control/span-<engine>.json with the next generation;
- every other rank runs under its node's `SpanFollower`, which starts its process for each new
  generation of its own attempt (killing the previous one first) and, when that process exits,
  records the exit in control/span-<engine>-rank<r>.json. It never restarts on its own: a rank
  alone cannot rejoin an engine whose other ranks have moved on;
- rank 0's supervisor treats a recorded exit of the current generation like an exit of rank 0
  itself (`SpanLeader.failed_rank`): it restarts the engine, i.e. a new generation, which every
  rank then follows. When rank 0 dies the other ranks follow its next generation the same way.
  Ranks that cannot meet (a node gone) never make rank 0 healthy: its start times out and counts
  against the restart budget like any failed start.

With attention data parallelism (`--sglang-attn-dp-size N`, the deprecated
`--sglang-enable-dp-attention`, or the same keys in a `--sglang-config` file: judged on the values
SGLang resolves, engines/sglang_args.py `attention_dp`) the nodes of one engine talk over ZMQ TCP ports on
the dist-init host (dist-init port + 1 .. + 6, sglang/srt/server_args.py PortArgs.init_new, 0.5.23)
that accept pickled objects without authentication: anyone who reaches them runs code as the user.
Such an engine is refused at submit (`span_exposure_refusal`), and again on the rollout node with its
own SGLang before any engine starts (`check_on_node`), unless the user names the interface
those ports bind (`--engine-span-interface`: rank 0 then meets its ranks on that interface's address,
`SpanLeader(bind_host=...)`) or states that they are closed otherwise (`--engine-span-ports-closed`);
docs/security.md lists every port.

Weight sync needs nothing else: the trainer talks to rank 0's URL and gives the engine as many
group ranks as its whole TP size (control/engines.json `ranks`); SGLang passes the calls on to every
rank, on every node. Under --colocate the IPC transport also needs each rank's node: rank 0's record
lists them (`nodes`, from the followers' span-rank records; engines/supervisor.py `span_nodes`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading

from rlslurm.buffer.control import Control, SpanRankRecord, SpanRecord
from rlslurm.engines.engine import EngineProcess, EngineSpec
from rlslurm.engines.sglang_args import FALLBACK, Table, attention_dp, read_passthrough
from rlslurm.errors import ConfigError
from rlslurm.net import consecutive_ports

log = logging.getLogger(__name__)

# The dist-init port and the ports SGLang derives from it for ZMQ between the nodes (port + 1 ..
# port + 6 with DP attention, sglang/srt/server_args.py PortArgs.init_new, 0.5.23), with room to spare.
DIST_INIT_PORTS = 8


def dist_init_addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


SECURITY_DOC = 'docs/security.md, "Engines spanning nodes"'


def span_exposure_refusal(sglang_args: list[str] | tuple[str, ...], nodes_per_engine: int, interface: str | None,
                          ports_closed: bool, table: Table | None = None) -> str | None:
    """Why an engine spanning nodes may not start as configured, or None: with attention data
    parallelism its ZMQ ports run code for whoever connects (module docstring), so the user must say
    where they bind or that they are closed. Judged on what SGLang resolves (engines/sglang_args.py
    `attention_dp`: --attn-dp-size, --enable-dp-attention, a --config file's keys, ...); `table`: the
    installed SGLang's parser, else the flags rlslurm knows."""
    if nodes_per_engine < 2 or interface or ports_closed:
        return None
    on = attention_dp(read_passthrough(sglang_args, table).resolve(table or FALLBACK))
    if on is None:
        return None
    return (f"{on.said} (SGLang's attention data parallelism) with an engine spanning {nodes_per_engine} nodes: "
            f"SGLang's ZMQ ports between them accept pickled objects from anyone who can connect (code runs as "
            f"you); name the private interface they bind with --engine-span-interface IFNAME, or pass "
            f"--engine-span-ports-closed if a firewall or a private job network closes them ({SECURITY_DOC})")


def check_on_node(sglang_args: list[str] | tuple[str, ...], nodes_per_engine: int, interface: str | None,
                  ports_closed: bool) -> None:
    """The rollout node, before it starts an engine: the passthrough judged again with this node's own
    SGLang (submit may have had none, or another), its --config file read as it is now: owned flags
    and the spanning engine's exposure."""
    from rlslurm.engines.sglang_flags import check_owned, sglang_installed, sglang_parser_table

    if not sglang_args or not sglang_installed():  # no engine can start here anyway (engine.py says so)
        return
    table = sglang_parser_table()
    p = read_passthrough(sglang_args, table)
    check_owned(p, table)
    if (why := span_exposure_refusal(sglang_args, nodes_per_engine, interface, ports_closed, table)) is not None:
        raise ConfigError(why)


class SpanLeader:
    """Node rank 0's side: the supervisor's hooks for its engines that span nodes (an engine of one
    node passes through untouched)."""

    def __init__(self, control: Control, *, attempt: int, bind_host: str | None = None):
        """`bind_host`: the address the ranks meet on (and SGLang's ports between them bind), the
        --engine-span-interface's on this node; None: the engine's own host."""
        self.control, self.attempt, self.bind_host = control, attempt, bind_host
        self._generation: dict[str, int] = {}

    def prepare(self, spec: EngineSpec) -> EngineSpec:
        """The spec for rank 0's next start, after telling the other ranks where to meet."""
        if spec.nnodes == 1:
            return spec
        host = self.bind_host or spec.host
        addr = dist_init_addr(host, consecutive_ports(host, DIST_INIT_PORTS))
        gen = self._generation.get(spec.name, 0) + 1
        self.control.write_span(SpanRecord(engine=spec.name, attempt=self.attempt, generation=gen,
                                           dist_init_addr=addr, nnodes=spec.nnodes))
        self._generation[spec.name] = gen
        log.info("%s: generation %d meets at %s (%d nodes)", spec.name, gen, addr, spec.nnodes)
        return dataclasses.replace(spec, dist_init_addr=addr)

    def failed_rank(self, spec: EngineSpec) -> str | None:
        """Why the engine must restart, when another node's rank of its current generation exited."""
        gen = self._generation.get(spec.name)
        if spec.nnodes == 1 or gen is None:
            return None
        for r in range(1, spec.nnodes):
            rec = self.control.span_rank(spec.name, r)
            if rec is None or rec.attempt != self.attempt or rec.generation != gen:
                continue
            if rec.exit_code is not None or rec.error is not None:
                how = f"code {rec.exit_code}" if rec.exit_code is not None else rec.error
                return f"exited: node rank {r} on {rec.node} ({how})"
        return None


class SpanFollower:
    """Node rank r > 0 of one engine: follows rank 0's generations (see the module docstring)."""

    def __init__(self, spec: EngineSpec, control: Control, *, attempt: int, node_name: str, poll_s: float = 1.0):
        if spec.node_rank < 1:
            raise ValueError(f"{spec.name}: node rank {spec.node_rank} is rank 0's, not a follower's")
        self.spec, self.control, self.attempt, self.node_name, self.poll_s = spec, control, attempt, node_name, poll_s
        self.proc = EngineProcess(spec)
        self.generation = 0
        self._reported = True   # nothing running yet: nothing to report
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def name(self) -> str:
        return f"{self.spec.name} node rank {self.spec.node_rank}"

    def start(self) -> "SpanFollower":
        self.tick()
        self._thread = threading.Thread(target=self._loop, name=f"span-{self.spec.name}", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.tick()
            except Exception:  # the follower must outlive one bad round (a torn control file, ...)
                log.exception("%s: follower round failed", self.name)

    def tick(self) -> None:
        rec = self.control.span(self.spec.name)
        with self._lock:
            if self._stop.is_set():
                return
            if rec is not None and rec.attempt == self.attempt and rec.generation > self.generation:
                self._follow(rec)
            elif not self._reported and not self.proc.is_alive():
                code = self.proc.proc.returncode if self.proc.proc else None
                log.warning("%s exited (code %s) in generation %d: rank 0 restarts the engine",
                            self.name, code, self.generation)
                self._record(exit_code=code)

    def _follow(self, rec: SpanRecord) -> None:
        self.proc.kill_tree()
        self.generation = rec.generation
        self.proc.spec = dataclasses.replace(self.spec, dist_init_addr=rec.dist_init_addr)
        try:
            self.proc.start()
        except Exception as e:  # cannot start here: rank 0 must hear of it, or it waits out its start
            log.error("%s: start for generation %d failed: %s", self.name, rec.generation, e)
            self._record(error=str(e).splitlines()[0] if str(e) else type(e).__name__)
            return
        log.info("%s: started for generation %d (pid %s), meeting at %s", self.name, rec.generation, self.proc.pid,
                 rec.dist_init_addr)
        self._reported = False
        self._record()

    def _record(self, *, exit_code: int | None = None, error: str | None = None) -> None:
        self._reported = exit_code is not None or error is not None
        self.control.write_span_rank(SpanRankRecord(
            engine=self.spec.name, attempt=self.attempt, generation=self.generation, node_rank=self.spec.node_rank,
            node=self.node_name, pid=self.proc.pid, exit_code=exit_code, error=error))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        with self._lock:
            self.proc.kill_tree()
