"""The `--sglang-*` passthrough flags: which rlslurm owns, and which the installed SGLang knows.

Checked by `resolve()` at submit (rlslurm/preflight.py) and again by every engine spec on the node.
SGLang builds most of its ~560 server flags in code, so the only exact list is its own argument
parser: `sglang_server_flags()` imports `sglang.srt.server_args` (~12 CPU-s), which is why resolve
only asks when there are passthrough flags to check, and why the list is kept in the user's cache
directory (~/.cache/rlslurm/, or $XDG_CACHE_HOME/rlslurm/), one file per installed SGLang (its
version, path and the modification times of the files that build its parser).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from pathlib import Path

from rlslurm.errors import ConfigError
from rlslurm.settings.argv import flag_value

# Flags rlslurm sets itself (engines/engine.py), with SGLang's aliases of them (--model is
# --model-path's, --tensor-parallel-size --tp-size's); a passthrough of one would silently fight
# the supervisor, and --api-key would put the run's secret on a command line. --nnodes, --node-rank
# and --dist-init-addr (alias --nccl-init-addr) are set for engines spanning nodes (engines/span.py).
OWNED_FLAGS = ("--model-path", "--model", "--host", "--port", "--nccl-port", "--base-gpu-id", "--tp-size",
               "--tensor-parallel-size", "--api-key", "--device", "--dtype", "--nnodes", "--node-rank",
               "--dist-init-addr", "--nccl-init-addr")


def passthrough_flags(args: list[str] | tuple[str, ...]) -> list[str]:
    """The flag names of a passthrough argv (`--x 1`, `--y=2`, `--z`), in order."""
    return [a.split("=", 1)[0] for a in args if a.startswith("--")]


def check_owned(args: list[str] | tuple[str, ...]) -> None:
    for flag in passthrough_flags(args):
        if flag in OWNED_FLAGS:
            raise ConfigError(f"--sglang-{flag[2:]}: rlslurm sets {flag} for every engine itself; "
                              f"remove it from the passthrough flags")


def sglang_installed() -> bool:
    return importlib.util.find_spec("sglang") is not None


def _probe() -> frozenset[str]:
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    return frozenset(o for o in parser._option_string_actions if o.startswith("--"))


def _cache_file() -> Path | None:
    """Where the flag list of the installed SGLang is kept: a name that changes whenever that SGLang
    does (another version, another place, a file of its parser changed); None without SGLang."""
    import hashlib
    import importlib.metadata

    spec = importlib.util.find_spec("sglang")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    srt = Path(list(spec.submodule_search_locations)[0]) / "srt"
    parts = [importlib.metadata.version("sglang"), str(srt.resolve())]
    for f in [srt / "server_args.py", *sorted((srt / "arg_groups").glob("*.py"))]:
        st = f.stat()
        parts.append(f"{f.name}:{st.st_mtime_ns}:{st.st_size}")
    key = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rlslurm"
    return root / f"sglang-flags-{parts[0]}-{key}.json"


@functools.lru_cache(maxsize=1)
def sglang_server_flags() -> frozenset[str]:
    """Every `--flag` of the installed SGLang's `launch_server` (its own parser), from the cache file
    when one was written for this SGLang; any trouble with the cache is a probe, never an error."""
    try:
        path = _cache_file()
    except OSError:
        path = None
    if path is not None:
        try:
            flags = json.loads(path.read_text())
            if isinstance(flags, list) and flags and all(isinstance(f, str) and f.startswith("--") for f in flags):
                return frozenset(flags)
        except (OSError, ValueError):
            pass
    flags = _probe()
    if path is not None:
        from rlslurm.buffer.atomic import StorageError, write_json_atomic

        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # whole or not at all, whoever else writes it at once; a cache needs no fsync
            write_json_atomic(path, sorted(flags), durable=False)
        except (OSError, StorageError):
            pass
    return flags


def unknown_flags(args: list[str] | tuple[str, ...], known: frozenset[str]) -> list[str]:
    return [f for f in passthrough_flags(args) if f not in known]


def unknown_flags_message(unknown: list[str], known: frozenset[str], version: str | None) -> str:
    import difflib

    hints = []
    for f in unknown:
        close = difflib.get_close_matches(f, sorted(known), n=1)
        hints.append(f"--sglang-{f[2:]}" + (f" (did you mean --sglang-{close[0][2:]}?)" if close else ""))
    return f"{', '.join(hints)}: not a flag of SGLang {version or ''} `launch_server`".replace("  ", " ")


def _int_flag(args, *names: str) -> int | None:
    v = flag_value(args, *names)
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError:
        raise ConfigError(f"--sglang-{names[0][2:]} {v!r}: not an integer") from None


def check_parallel(args: list[str] | tuple[str, ...], engine_gpus: int) -> None:
    """DP attention and expert parallelism inside one engine, checked against its size (the
    --rollout-num-gpus-per-engine GPUs it is given) before submit; SGLang would assert at start-up,
    after the queue wait. Its rules (sglang/srt/arg_groups/parallel_hook.py, 0.5.23): the attention
    DP size and the EP size divide the TP size, which is the engine's GPU count."""
    where = f"the engine's {engine_gpus} GPUs (--rollout-num-gpus-per-engine {engine_gpus})"
    dp = _int_flag(args, "--dp-size", "--data-parallel-size")
    dp_attention = flag_value(args, "--enable-dp-attention") is not None
    if dp is not None and dp > 1 and not dp_attention:
        raise ConfigError(f"--sglang-dp-size {dp} without --sglang-enable-dp-attention starts {dp} copies of the model "
                          f"in each engine, {dp * engine_gpus} GPUs, but each engine has {engine_gpus}: run more engines "
                          "instead, or add --sglang-enable-dp-attention (attention data-parallel within the engine)")
    for names, what in ((("--dp-size", "--data-parallel-size"), "attention data-parallel size"),
                        (("--ep-size", "--expert-parallel-size", "--ep"), "expert-parallel size"),
                        (("--moe-dense-tp-size",), "dense-layer TP size")):
        n = _int_flag(args, *names)
        if n is not None and (n < 1 or engine_gpus % n):
            raise ConfigError(f"--sglang-{names[0][2:]} {n}: the {what} must divide {where}")
