"""The `--sglang-*` passthrough flags: which rlslurm owns, and which the installed SGLang knows.

Checked by `resolve()` at submit (rlslurm/preflight.py) and again by every engine spec on the node.
SGLang builds most of its ~560 server flags in code, so the only exact list is its own argument
parser: `sglang_server_flags()` imports `sglang.srt.server_args` (seconds), which is why resolve
only asks when there are passthrough flags to check.
"""

from __future__ import annotations

import functools
import importlib.util

from rlslurm.errors import ConfigError

# Flags rlslurm sets itself (engines/engine.py), with SGLang's aliases of them (--model is
# --model-path's, --tensor-parallel-size --tp-size's); a passthrough of one would silently fight
# the supervisor, and --api-key would put the run's secret on a command line.
OWNED_FLAGS = ("--model-path", "--model", "--host", "--port", "--nccl-port", "--base-gpu-id", "--tp-size",
               "--tensor-parallel-size", "--api-key", "--device", "--dtype")


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


@functools.lru_cache(maxsize=1)
def sglang_server_flags() -> frozenset[str]:
    """Every `--flag` of the installed SGLang's `launch_server` (its own parser)."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    return frozenset(o for o in parser._option_string_actions if o.startswith("--"))


def unknown_flags(args: list[str] | tuple[str, ...], known: frozenset[str]) -> list[str]:
    return [f for f in passthrough_flags(args) if f not in known]


def unknown_flags_message(unknown: list[str], known: frozenset[str], version: str | None) -> str:
    import difflib

    hints = []
    for f in unknown:
        close = difflib.get_close_matches(f, sorted(known), n=1)
        hints.append(f"--sglang-{f[2:]}" + (f" (did you mean --sglang-{close[0][2:]}?)" if close else ""))
    return f"{', '.join(hints)}: not a flag of SGLang {version or ''} `launch_server`".replace("  ", " ")
