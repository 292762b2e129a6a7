"""A passthrough argv (`--sglang-*` flags, as rlslurm hands them to SGLang) read the way the
engine's own argparse will read it: the last `--name V` / `--name=V` wins. Below both roles, so
submit's checks (settings/low_precision.py, engines/sglang_flags.py) and the rollout node
(rollout/node.py) judge the value the engine will use, from one reading.
"""

from __future__ import annotations


def flag_value(args: list[str] | tuple[str, ...], *names: str) -> str | None:
    """The value of the last `--name V` / `--name=V` among `names` in a passthrough argv; "" for a bare
    switch; None when absent (argparse keeps the last occurrence, so do we)."""
    found = None
    for i, a in enumerate(args):
        flag, eq, value = a.partition("=")
        if flag in names:
            nxt = args[i + 1] if i + 1 < len(args) else None
            found = value if eq else (nxt if nxt is not None and not nxt.startswith("--") else "")
    return found
