"""rlslurm's CPU device path for SGLang: the one place that knows how to run it without a GPU.

SGLang has no official CPU path that installs from PyPI (its CPU engine needs a source build
of sgl-kernel). What works, measured with SGLang 0.5.23 on torch 2.13.0+cpu
(docs/sglang-behaviour.md, "CPU install and launch" and "Several servers on one CPU node"),
and what this module reproduces:

1. install `sglang==0.5.23 --no-deps` plus tools/sglang-cpu-requirements.txt, never
   torchvision (tools/install.sh does this);
2. put `stubs/` on the server's PYTHONPATH: an import-only `torchvision` and a pure-torch
   `vllm._custom_ops.rotary_embedding` (`cpu_env`);
3. launch with `--device cpu --attention-backend torch_native --sampling-backend pytorch`
   (`cpu_server_args`), plus `--sleep-on-idle` (an idle server otherwise busy-polls a core)
   and a fixed small KV pool, `--max-total-tokens`. On CPU SGLang measures "free device
   memory" system-wide: the KV budget is free-now minus (1 - mem_fraction_static) x
   free-before-load, and start-up fails ("Loaded weights leave no GPU memory for the KV
   cache") when other processes on the node allocate more than mem_fraction_static x
   free memory while the server loads. A generous fraction (0.5) only raises that bound;
   the pool itself stays at --max-total-tokens;
4. one intra-op thread per server (or a pinned core): two servers with torch's default
   threads on the same cores slow down ~30x.

It is an unofficial path pinned to SGLANG_VERSION; `check_sglang_version` refuses anything
else with a clear message rather than failing somewhere inside a server's start-up.
Used only when the rollout device is cpu.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rlslurm.engines.sglang_versions import SUPPORTED, installed_sglang_version
from rlslurm.errors import ConfigError

SGLANG_VERSION = next(v for v, api in SUPPORTED.items() if api.cpu_path)
STUBS_DIR = Path(__file__).resolve().parent / "stubs"
# Small and fixed: deterministic, and leaves room for several servers on a 24 GiB box.
DEFAULT_MAX_TOTAL_TOKENS = 16384


def check_sglang_version() -> None:
    """Raise ConfigError unless the installed SGLang is the one this CPU path is known to work with."""
    found = installed_sglang_version()
    if found != SGLANG_VERSION:
        what = "is not installed" if found is None else f"is {found}"
        raise ConfigError(
            f"rollout device cpu: SGLang {what}, but the CPU path (rlslurm/engines/sglang_cpu) is "
            f"pinned to sglang=={SGLANG_VERSION}; run tools/install.sh (it installs "
            f"sglang=={SGLANG_VERSION} --no-deps with its CPU dependency set)"
        )


def cpu_env(base_env: dict[str, str], *, threads: int = 1, tp_size: int = 1, core: int | None = None) -> dict[str, str]:
    """A copy of `base_env` for one CPU SGLang server: stubs first on PYTHONPATH, `threads`
    intra-op threads (OMP/MKL/torch all read OMP_NUM_THREADS).

    A server of several TP ranks (on CPU: one rank per node of an engine spanning nodes,
    engines/span.py) needs SGLANG_CPU_OMP_THREADS_BIND, one `|` entry per rank, or every rank
    fails its start when the ranks outnumber the NUMA nodes (docs/sglang-behaviour.md, "One
    engine over several nodes"). Each rank reads the entry of its device index, so every entry is
    this process's own core: whichever it reads, it binds where `taskset` put it."""
    if threads < 1:
        raise ConfigError(f"sglang cpu threads must be >= 1, got {threads}")
    env = dict(base_env)
    if tp_size > 1:
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join([str(core if core is not None else 0)] * tp_size)
    old = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = str(STUBS_DIR) + (os.pathsep + old if old else "")
    env["OMP_NUM_THREADS"] = str(threads)
    env["MKL_NUM_THREADS"] = str(threads)
    return env


def cpu_server_args(*, max_total_tokens: int = DEFAULT_MAX_TOTAL_TOKENS) -> list[str]:
    """The `sglang.launch_server` flags the CPU path needs; user flags placed after these win
    (argparse keeps the last occurrence)."""
    if max_total_tokens < 1:
        raise ConfigError(f"sglang --max-total-tokens must be >= 1, got {max_total_tokens}")
    return [
        "--device", "cpu",
        "--attention-backend", "torch_native",
        "--sampling-backend", "pytorch",
        "--sleep-on-idle",
        "--mem-fraction-static", "0.5",
        "--max-total-tokens", str(max_total_tokens),
    ]


def is_cpu_launch(args: list[str]) -> bool:
    """True when `sglang.launch_server` ARGS run the server on the CPU (`cpu_server_args`)."""
    return any(a == "--device" and nxt == "cpu" for a, nxt in zip(args, args[1:])) or "--device=cpu" in args


def fork_subprocesses() -> None:
    """Make SGLang start its scheduler and detokenizer by fork instead of spawn, in this process.

    SGLang forces `spawn` (`_set_envs_and_config`), which CUDA needs: each child then imports
    SGLang and torch again. On the CPU nothing holds a device or a thread pool yet when the
    children start (one intra-op thread, `cpu_env`), and a forked child inherits the imports:
    a server's start-up, measured on 2 busy cores, took 84 s with spawn and 69 s with fork (the
    scheduler's 43-s import gone; docs/sglang-behaviour.md, "CPU start-up"). Call before
    SGLang's launch code runs; never on a GPU server. Also hides megatron-core from the server."""
    import multiprocessing

    real = multiprocessing.set_start_method

    def fork_instead(method: str | None = None, force: bool = False) -> None:
        real("fork" if method == "spawn" else method, force=force)

    multiprocessing.set_start_method = fork_instead  # type: ignore[assignment]  # SGLang calls mp.set_start_method
    # SGLang's tensor dumper imports megatron-core at class definition when it is installed (it is,
    # beside rlslurm's trainer): 3.5 s of every scheduler's start for a debug plugin a server never
    # uses. Marked absent, its import fails as on a machine without it, which the dumper handles.
    sys.modules.setdefault("megatron", None)  # type: ignore[arg-type]
