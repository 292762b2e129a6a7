"""One SGLang server process: how to launch it, wait for it, and kill it completely.

`EngineSpec` is everything that distinguishes one server from another; `EngineProcess` owns
the OS process. The server is started from an argv list (never a shell string) in its own
process group, so one SIGKILL to the group ends the HTTP process, the scheduler(s) and the
detokenizer together even when the main process is already gone.

The api key does not go on the command line (any user on the node can read
/proc/<pid>/cmdline): the server is launched as `python -m rlslurm.engines.engine
sglang.launch_server ARGS`, and this module's `__main__` appends `--api-key` from the
environment (readable only by the owner) before handing over to SGLang in-process. SGLang logs
its config, key included; `__main__` sends the server's output through a filter that masks the
key (engines/log_scrub.py), and the log file itself is 0600 (buffer/atomic.py `open_log`). It
also forks a watcher that ends the server if the rollout process dies (engines/owner_watch.py).

SGLang leaves files behind when killed (docs/sglang-behaviour.md, "Files left behind on kill"):
`/dev/shm/sglang_loads_*`,
`/dev/shm/sem.mp-*` and its ZMQ IPC names in the temp dir. Each server gets a private TMPDIR
(removed with it), and the /dev/shm files are identified by inode from what the server's
processes have mapped or open, so another server's files are never touched.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rlslurm.buffer.atomic import open_log
from rlslurm.engines import log_scrub, memory_share, owner_watch, procfs, sglang_cpu, sglang_flags, sglang_versions
from rlslurm.engines.memory_share import MemoryPlan
from rlslurm.engines.procfs import pid_alive
from rlslurm.engines.sglang_client import health_sync
from rlslurm.errors import ConfigError, UserError
from rlslurm.net import check_ip_literal

ENV_API_KEY = "RLSLURM_SGLANG_API_KEY"
SGLANG_MODULE = "sglang.launch_server"
ROUTER_MODULE = "sglang_router.launch_router"  # started through this module too (engines/router.py)
DTYPES = ("auto", "float32", "bfloat16", "float16", "half", "float")
_SHM_PATTERNS = (re.compile(r"^/dev/shm/sglang_loads_.*\.shm$"), re.compile(r"^/dev/shm/sem\.mp-[^/]+$"))


class EngineStartError(RuntimeError):
    """An SGLang server exited or did not become healthy; the message ends with its log tail."""


class EngineSetupError(UserError):
    """The engine's own process refused to start SGLang (its one line, ENGINE_ERROR_MARK in its log):
    a setting must change, a restart cannot help."""


class EngineOutOfMemory(UserError):
    """An engine died of CUDA out-of-memory: restarting it the same way dies the same way (the share of
    the GPU it takes must change), so it is reported once and the attempt ends."""


ENGINE_ERROR_MARK = "rlslurm engine error: "
# What a CUDA out-of-memory death leaves in an SGLang log (torch's allocator, torch_memory_saver's
# resume, CUDA runtime/driver calls): docs/sglang-behaviour.md, "Out of memory".
_OOM = re.compile(r"OutOfMemoryError|CUDA out of memory|CUDA error: out of memory|cudaErrorMemoryAllocation|"
                  r"CUDA_ERROR_OUT_OF_MEMORY|torch_memory_saver.*out of memory|Tried to allocate [0-9.]+ [GM]iB")


@dataclass(frozen=True)
class EngineSpec:
    name: str                       # "engine-3": used in logs, metrics and control files
    model_path: str
    host: str                       # IP literal the server binds and is dialled on
    port: int
    nccl_port: int
    log_path: Path
    base_gpu_id: int = 0
    tp_size: int = 1
    api_key: str | None = None
    dtype: str = "auto"
    device: Literal["cuda", "cpu"] = "cuda"
    extra_args: tuple[str, ...] = ()    # every --sglang-* passthrough, already stripped of the prefix
    cpu_core: int | None = None         # pin the whole server to this core (taskset)
    skip_warmup: bool = True
    max_total_tokens: int | None = None  # None: SGLang's own sizing (cpu: sglang_cpu default)
    # An engine spanning nodes (engines/span.py): this process is node rank `node_rank` of `nnodes`,
    # tp_size is the whole engine's, and every rank meets at `dist_init_addr` (host:port of rank 0).
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    allow_untested_sglang: bool = False   # --allow-untested-sglang (engines/sglang_versions.py)
    # --colocate / --shared-gpu: the engine's process waits for the trainer to leave the GPUs and, on
    # GPUs, sizes its memory share before SGLang starts (engines/memory_share.py)
    memory: MemoryPlan | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "host", check_ip_literal(self.host, where=f"{self.name} host"))
        object.__setattr__(self, "log_path", Path(self.log_path))
        object.__setattr__(self, "extra_args", tuple(self.extra_args))
        for what, port in (("port", self.port), ("nccl_port", self.nccl_port)):
            if not 0 < port < 65536:
                raise ConfigError(f"{self.name}: {what} {port} is not a valid TCP port")
        if self.port == self.nccl_port:
            raise ConfigError(f"{self.name}: port and nccl_port must differ (both {self.port})")
        if self.tp_size < 1 or self.base_gpu_id < 0:
            raise ConfigError(f"{self.name}: tp_size must be >= 1 and base_gpu_id >= 0 "
                              f"(got {self.tp_size}, {self.base_gpu_id})")
        if self.dtype not in DTYPES:
            raise ConfigError(f"{self.name}: dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.device not in ("cuda", "cpu"):
            raise ConfigError(f"{self.name}: device {self.device!r} must be cuda or cpu")
        sglang_flags.check_owned(self.extra_args)
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes or self.tp_size % self.nnodes:
            raise ConfigError(f"{self.name}: node rank {self.node_rank} of {self.nnodes} nodes with tp_size "
                              f"{self.tp_size} (a multiple of the node count) is not a valid engine span")

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def server_args(self) -> list[str]:
        """The flags for `sglang.launch_server`, without the api key (see module docstring)."""
        args = ["--model-path", self.model_path, "--host", self.host, "--port", str(self.port),
                "--nccl-port", str(self.nccl_port), "--base-gpu-id", str(self.base_gpu_id),
                "--tp-size", str(self.tp_size), "--dtype", self.dtype]
        if self.nnodes > 1:
            if self.dist_init_addr is None:
                raise ConfigError(f"{self.name}: an engine over {self.nnodes} nodes needs its dist-init address")
            args += ["--nnodes", str(self.nnodes), "--node-rank", str(self.node_rank),
                     "--dist-init-addr", self.dist_init_addr]
        if self.skip_warmup:
            args.append("--skip-server-warmup")
        if self.device == "cpu":
            args += sglang_cpu.cpu_server_args(
                max_total_tokens=self.max_total_tokens or sglang_cpu.DEFAULT_MAX_TOTAL_TOKENS)
        else:
            args += ["--device", "cuda"]
            if self.max_total_tokens:
                args += ["--max-total-tokens", str(self.max_total_tokens)]
        return args + list(self.extra_args)

    def argv(self) -> list[str]:
        cmd = [sys.executable, "-m", "rlslurm.engines.engine", SGLANG_MODULE, *self.server_args()]
        if self.cpu_core is not None:
            cmd = ["taskset", "-c", str(self.cpu_core), *cmd]
        return cmd

    def env(self, base: dict[str, str] | None = None, *, tmpdir: str | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        if tmpdir is not None:
            env["TMPDIR"] = tmpdir
        if self.device == "cpu":
            env = sglang_cpu.cpu_env(env, threads=1, tp_size=self.tp_size, core=self.cpu_core)
        # SGLang calls its own HTTP port (warm-up, /freeze_gc) with `requests`, which honours
        # http_proxy; keep the proxy for the outside world (hub downloads) but not for itself.
        bypass = [self.host, "127.0.0.1", "localhost"]
        for var in ("no_proxy", "NO_PROXY"):
            have = [h for h in env.get(var, "").split(",") if h]
            env[var] = ",".join(have + [h for h in bypass if h not in have])
        env.pop(ENV_API_KEY, None)
        if self.api_key:
            env[ENV_API_KEY] = self.api_key
        for var in (memory_share.ENV, memory_share.ENV_RECORD):
            env.pop(var, None)
        if self.memory is not None:
            env[memory_share.ENV] = self.memory.to_env()
            env[memory_share.ENV_RECORD] = str(memory_share.record_path(self.log_path))
        return env


@dataclass
class EngineProcess:
    """The OS side of one engine. Not thread-safe: one owner (the supervisor) drives it."""

    spec: EngineSpec
    proc: subprocess.Popen | None = None
    starts: int = 0
    started_at: float = 0.0
    _owned_files: set[str] = field(default_factory=set)
    _tmpdir: str | None = None

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> None:
        if self.is_alive():
            raise RuntimeError(f"{self.spec.name}: already running (pid {self.pid})")
        if self.spec.device == "cpu":
            sglang_cpu.check_sglang_version()
        else:
            api = sglang_versions.check_gpu_sglang(self.spec.allow_untested_sglang)
            # an INT4 checkpoint's engine needs the weight-update session (0.5.23): refused here, where
            # the version is known, before it serves weights no sync could replace (docs/low-precision.md)
            from rlslurm.settings.low_precision import check_int4_engine

            check_int4_engine(self.spec.model_path, api.weight_update_session, api.version)
        # Short on purpose: ZMQ ipc paths must fit in a unix socket address (108 bytes).
        self._tmpdir = tempfile.mkdtemp(prefix=f"rlsl-{self.spec.port}-")
        with open_log(self.spec.log_path) as log:
            log.write(f"\n==== rlslurm: start #{self.starts + 1} of {self.spec.name} at {time.ctime()}: "
                      f"{' '.join(self.spec.argv())}\n".encode())
            log.flush()
            # the log filter (engines/log_scrub.py) rotates the log past its size bound
            env = {**self.spec.env(tmpdir=self._tmpdir), **log_scrub.rotate_env(self.spec.log_path)}
            self.proc = subprocess.Popen(self.spec.argv(), env=env, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.starts += 1
        self.started_at = time.monotonic()
        self._owned_files = set()

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_healthy(self, timeout: float, *, poll_s: float = 0.5) -> float:
        """Block until GET /health answers 200; returns seconds since start. Raises
        EngineStartError if the process exits first or `timeout` passes."""
        if self.proc is None:
            raise RuntimeError(f"{self.spec.name}: wait_healthy before start")
        deadline = time.monotonic() + timeout
        while True:
            # Recorded on every poll, not only once healthy: a server that dies or is killed
            # during start-up has already created its /dev/shm files.
            self.record_owned_files()
            if not self.is_alive():
                wait_group_gone(self.proc.pid)  # the log filter writes the server's last words
                refused = self.refused_arguments()
                if refused:
                    raise ConfigError(f"--sglang-* passthrough: SGLang on {socket.gethostname()} refused it: {refused}")
                self.raise_if_final("at its start")
                raise EngineStartError(f"{self.spec.name} ({self.url}) exited with code {self.proc.returncode} "
                                       f"before it became healthy; log {self.spec.log_path}:\n{self.log_tail()}")
            if health_sync(self.url, timeout=min(5.0, max(0.5, deadline - time.monotonic()))):
                self.record_owned_files()
                return time.monotonic() - self.started_at
            if time.monotonic() > deadline:
                raise EngineStartError(f"{self.spec.name} ({self.url}) not healthy after {timeout:g} s; "
                                       f"log {self.spec.log_path}:\n{self.log_tail()}")
            time.sleep(poll_s)

    def refused_arguments(self) -> str | None:
        """argparse's one-line complaint when the server exited refusing its arguments (exit code 2:
        a passthrough flag this node's SGLang does not know, or a bad value), else None."""
        if self.proc is None or self.proc.returncode != 2:
            return None
        try:
            text = self.spec.log_path.read_text(errors="replace")
        except OSError:
            return None
        m = re.search(r"^[^\n]*?: error: ((?:unrecognized arguments|argument --)[^\n]*)$", text, re.MULTILINE)
        return m.group(1).strip() if m else None

    def _this_start_log(self) -> list[str]:
        """The log lines of this process's start (from rlslurm's start line on)."""
        try:
            lines = self.spec.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []
        starts = [i for i, line in enumerate(lines) if line.startswith("==== rlslurm: start #")]
        return lines[starts[-1]:] if starts else lines

    def raise_if_final(self, when: str) -> None:
        """After the process ended: EngineSetupError (the wrapper's own refusal) or EngineOutOfMemory
        (CUDA OOM, `when`: at its start, or since), with the line that says so; nothing otherwise."""
        lines = self._this_start_log()
        for line in reversed(lines):
            if line.startswith(ENGINE_ERROR_MARK):
                raise EngineSetupError(f"{self.spec.name}: {line.removeprefix(ENGINE_ERROR_MARK)}")
        oom = next((line.strip() for line in reversed(lines) if _OOM.search(line)), None)
        if oom is None:
            return
        # the share's line ("rlslurm engine memory (info|warning): ..."), not the waiting or the trainer's
        share = next((line.split(": ", 1)[1] for line in lines if line.startswith("rlslurm engine memory (")),
                     "SGLang's own default share")
        raise EngineOutOfMemory(
            f"{self.spec.name} ran out of GPU memory {when} ({oom[:300]}); its memory share: {share}. Give the "
            f"engines less of the GPU with --sglang-mem-fraction-static (below the share above), or the trainer "
            f"less (--offload-train, a smaller --max-tokens-per-gpu); log {self.spec.log_path}")

    def log_tail(self, n: int = 20) -> str:
        try:
            lines = self.spec.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])

    # --- ending ---------------------------------------------------------------------------
    def tree_pids(self) -> list[int]:
        """The server's processes: its process group, plus descendants that left it."""
        if self.proc is None:
            return []
        pgid = self.proc.pid
        pids = {p for p in procfs.all_pids() if procfs.pgid(p) == pgid and pid_alive(p)}
        if self.is_alive():
            pids.add(self.proc.pid)
        pids |= {p for p in procfs.descendants(self.proc.pid) if pid_alive(p)}
        return sorted(pids)

    def record_owned_files(self) -> None:
        """Remember the /dev/shm files and IPC sockets the server's processes hold, so that
        kill_tree can remove exactly those (and nothing of another server's)."""
        self._owned_files |= _files_held_by(self.tree_pids())

    def kill_tree(self, *, timeout: float = 30.0) -> None:
        """SIGKILL the whole tree, reap it, and remove its leftover files. Idempotent."""
        if self.proc is None:
            return
        pids = procfs.pin(self.tree_pids())
        self._owned_files |= _files_held_by(list(pids))
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        procfs.signal_each(pids, signal.SIGKILL)  # descendants that called setsid are not in the group
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{self.spec.name}: pid {self.proc.pid} survived SIGKILL for {timeout:g} s") from None
        procfs.wait_gone(pids, timeout)
        for path in self._owned_files:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError:
                pass  # not ours to fight over (permissions); the file is harmless
        self._owned_files = set()
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def restart(self) -> None:
        self.kill_tree()
        self.start()


def wait_group_gone(pgid: int, timeout_s: float = 5.0) -> None:
    """Wait (bounded) until no live process is left in process group `pgid`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and procfs.group_alive(pgid):
        time.sleep(0.05)


def _files_held_by(pids: list[int]) -> set[str]:
    """The /dev/shm files (sglang_loads_*, sem.mp-*) that `pids` have mapped or open. Matched
    by inode: glibc creates a named semaphore under a temp name and links it, so the mapping
    shows /dev/shm/sem.XXXXXX while the leftover is /dev/shm/sem.mp-*."""
    inodes: set[int] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    parts = line.rstrip("\n").split(maxsplit=5)
                    if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                        inodes.add(int(parts[4]))
        except (OSError, ValueError):
            pass
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/dev/shm/"):
                    inodes.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
            except OSError:
                continue
    found: set[str] = set()
    if not inodes:
        return found
    try:
        entries = list(os.scandir("/dev/shm"))
    except OSError:
        return found
    for entry in entries:
        path = entry.path
        try:
            if any(p.match(path) for p in _SHM_PATTERNS) and entry.inode() in inodes:
                found.add(path)
        except OSError:
            continue
    return found


def _main(argv: list[str]) -> None:
    """`python -m rlslurm.engines.engine MODULE ARGS...`: run MODULE as __main__ with
    `--api-key $RLSLURM_SGLANG_API_KEY` appended, so the key never appears in argv."""
    import runpy

    if not argv:
        raise SystemExit("usage: python -m rlslurm.engines.engine MODULE [ARGS...]")
    module, args = argv[0], argv[1:]
    key = os.environ.pop(ENV_API_KEY, None)
    rotate = log_scrub.parse_rotate_env(os.environ.pop(log_scrub.ENV_LOG_ROTATE, None))
    owner_watch.start()  # ends this server if the rollout process dies without stopping it (its wait too)
    try:
        # sharing its GPUs with the trainer: wait for it to leave them, then the share (before SGLang starts)
        args = memory_share.apply_from_env(args, cuda=not sglang_cpu.is_cpu_launch(args))
    except UserError as e:
        print(f"{ENGINE_ERROR_MARK}{' '.join(str(e).split())}", file=sys.stderr, flush=True)
        raise SystemExit(3) from None
    scrubber = None
    if key:
        # One token: a key starting with '-' would otherwise be parsed as an option.
        args = [*args, f"--api-key={key}"]
        scrubber = log_scrub.redirect_through_scrubber(key, rotate)  # before SGLang starts any thread
    sys.argv = [module, *args]
    if module == ROUTER_MODULE:
        # sglang-router's launcher imports its Python mini load balancer, which imports SGLang's
        # tracing and with it all of SGLang (torch, transformers: ~11 CPU-s, as much as an engine's
        # start) for the Rust router, which needs none of it. Without it the mini LB (--mini-lb,
        # debugging only) runs untraced (its own fallback when SGLang is not installed).
        sys.modules.setdefault("sglang.srt.tracing.trace", None)
    if sglang_cpu.is_cpu_launch(args):
        sglang_cpu.fork_subprocesses()
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        if scrubber is not None:
            log_scrub.finish(scrubber)


if __name__ == "__main__":
    _main(sys.argv[1:])
