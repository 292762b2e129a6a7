"""The `--sglang-*` passthrough flags: which rlslurm owns, and which the installed SGLang knows.

Checked by `resolve()` at submit (rlslurm/preflight.py), by every engine spec on the node, and before
the rollout node starts its engines (engines/span.py `check_on_node`), on the values SGLang will resolve
(engines/sglang_args.py: aliases, abbreviations, a --config file). SGLang builds most of its ~560
server flags in code, so the only exact list is its own argument parser: `sglang_parser_table()`
imports `sglang.srt.server_args` (~12 CPU-s), which is why resolve only asks when there are
passthrough flags to check, and why the table is kept in the user's cache directory
(~/.cache/rlslurm/, or $XDG_CACHE_HOME/rlslurm/), one file per installed SGLang (its version, path and
the modification times of the files that build its parser).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from pathlib import Path

from rlslurm.engines.sglang_args import FALLBACK, Passthrough, Table, as_int, match_option, read_passthrough
from rlslurm.errors import ConfigError

# Flags rlslurm sets itself (engines/engine.py), with SGLang's aliases of them (--model is
# --model-path's, --tensor-parallel-size --tp-size's); a passthrough of one would silently fight
# the supervisor, and --api-key would put the run's secret on a command line. --nnodes, --node-rank
# and --dist-init-addr (alias --nccl-init-addr) are set for engines spanning nodes (engines/span.py).
OWNED_FLAGS = ("--model-path", "--model", "--host", "--port", "--nccl-port", "--base-gpu-id", "--tp-size",
               "--tensor-parallel-size", "--api-key", "--device", "--dtype", "--nnodes", "--node-rank",
               "--dist-init-addr", "--nccl-init-addr")
# ... and their dests in SGLang's parser: an alias or an abbreviation of one resolves to these
OWNED_DESTS = frozenset(FALLBACK[f][0] for f in OWNED_FLAGS)


def passthrough_flags(args: list[str] | tuple[str, ...]) -> list[str]:
    """The flag names of a passthrough argv (`--x 1`, `--y=2`, `--z`), in order."""
    return [a.split("=", 1)[0] for a in args if a.startswith("--")]


def check_owned(args: list[str] | tuple[str, ...] | Passthrough, table: Table | None = None) -> None:
    """No passthrough flag, and no key of its --config file, that sets what rlslurm sets: by the dest
    it resolves to in `table` (the installed SGLang's: aliases and abbreviations included), else by
    name."""
    p = args if isinstance(args, Passthrough) else read_passthrough(args, table)
    for flag, written in p.flags():
        opt = match_option(flag, table) if table is not None else (flag if flag in OWNED_FLAGS else None)
        if opt is not None and table is not None and table[opt][0] not in OWNED_DESTS:
            opt = None
        if opt is not None:
            raise ConfigError(f"{written}: rlslurm sets {opt} for every engine itself; remove it from the "
                              f"passthrough flags")


def sglang_installed() -> bool:
    return importlib.util.find_spec("sglang") is not None


def _probe() -> Table:
    """The installed SGLang's parser as a table (engines/sglang_args.py `Table`)."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    table: Table = {}
    for opt, a in parser._option_string_actions.items():
        if not opt.startswith("--"):
            continue
        if isinstance(a, argparse._StoreTrueAction):
            config = "store_true"
        elif isinstance(a, argparse._StoreAction) or a.nargs is None:
            config = "one"  # as SGLang's ConfigArgumentMerger `_takes_one_value` decides
        else:
            config = "unsupported"
        const = a.const
        if isinstance(a, argparse.BooleanOptionalAction):
            const = not opt.startswith("--no-")
        elif a.nargs == 0 and const is None:
            const = True
        if not isinstance(const, (bool, int, float, str, type(None))):
            const = str(const)
        table[opt] = [a.dest, a.nargs, const, config]
    return table


CACHE_FORMAT = 1


def _cache_file() -> Path | None:
    """Where the parser table of the installed SGLang is kept: a name that changes whenever that SGLang
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
    return root / f"sglang-parser-{parts[0]}-{key}.json"


def _valid(table: object) -> bool:
    return (isinstance(table, dict) and bool(table)
            and all(isinstance(k, str) and k.startswith("--") and isinstance(v, list) and len(v) == 4
                    and isinstance(v[0], str) for k, v in table.items()))


@functools.lru_cache(maxsize=1)
def sglang_parser_table() -> Table:
    """The installed SGLang's `launch_server` parser (its own, every flag), from the cache file when one
    was written for this SGLang; any trouble with the cache is a probe, never an error."""
    try:
        path = _cache_file()
    except OSError:
        path = None
    if path is not None:
        try:
            kept = json.loads(path.read_text())
            if isinstance(kept, dict) and kept.get("format") == CACHE_FORMAT and _valid(kept.get("options")):
                return kept["options"]
        except (OSError, ValueError):
            pass
    table = _probe()
    if path is not None:
        from rlslurm.buffer.atomic import StorageError, write_json_atomic

        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # whole or not at all, whoever else writes it at once; a cache needs no fsync
            write_json_atomic(path, {"format": CACHE_FORMAT, "options": table}, durable=False)
        except (OSError, StorageError, ValueError):
            pass
    return table


def sglang_server_flags() -> frozenset[str]:
    """Every `--flag` of the installed SGLang's `launch_server` (`sglang_parser_table`)."""
    return frozenset(sglang_parser_table())


def unknown_flags(args: list[str] | tuple[str, ...] | Passthrough, known: frozenset[str] | Table) -> list[str]:
    """Flags (as the user wrote them: `--sglang-x`, or a key of the --config file) that are not exactly a
    flag of SGLang's: an abbreviation SGLang's argparse would expand is refused too (it would change
    meaning with the next SGLang)."""
    p = args if isinstance(args, Passthrough) else read_passthrough(args, known if isinstance(known, dict) else None)
    return [written for flag, written in p.flags() if flag not in known]


def value_count_error(p: Passthrough, table: Table) -> str | None:
    """The first command-line flag given more or fewer values than SGLang's parser takes (a switch
    with a value, a one-value flag with two), in one line; None when every flag takes what it is given."""
    from rlslurm.engines.sglang_args import match_option

    i, cli = 0, p.cli
    while i < len(cli):
        tok = cli[i]
        j = i + 1
        while j < len(cli) and not cli[j].startswith("--"):
            j += 1
        if tok.startswith("--"):
            name, eq, _ = tok.partition("=")
            opt = match_option(name, table)
            values = cli[i + 1:j]
            n = len(values) + (1 if eq else 0)
            nargs = table[opt][1] if opt is not None else None
            if opt is not None:
                ok = {0: n == 0, None: n == 1, "?": n <= 1, "+": n >= 1, "*": True}.get(nargs, n == nargs)
                if not ok:
                    want = {0: "no value", None: "one value", "?": "at most one value", "+": "one value or more"
                            }.get(nargs, f"{nargs} values")
                    got = " ".join(values) if values else "none"
                    return f"--sglang-{name[2:]} takes {want} in SGLang, got {got!r}"
        i = j
    return None


def unknown_flags_message(unknown: list[str], known: frozenset[str] | Table, version: str | None) -> str:
    import difflib

    hints = []
    for written in unknown:
        config_key = written.startswith("key ")
        name = written.split()[1] if config_key else written.removeprefix("--sglang-")
        close = difflib.get_close_matches("--" + name, sorted(known), n=1)
        hint = (f"{close[0][2:]}" if config_key else f"--sglang-{close[0][2:]}") if close else None
        hints.append(written + (f" (did you mean {hint}?)" if hint else ""))
    return f"{', '.join(hints)}: not a flag of SGLang {version or ''} `launch_server`".replace("  ", " ")


def check_parallel(args: list[str] | tuple[str, ...] | Passthrough, engine_gpus: int,
                   table: Table | None = None) -> None:
    """DP attention and expert parallelism inside one engine, checked against its size (the
    --rollout-num-gpus-per-engine GPUs it is given) before submit; SGLang would assert at start-up,
    after the queue wait. Its rules (sglang/srt/arg_groups/parallel_hook.py, 0.5.23): the attention
    DP size and the EP size divide the TP size, which is the engine's GPU count; data-parallel
    replicas (--dp-size without attention DP) are more engines' worth of GPUs. Judged on the resolved
    values (engines/sglang_args.py), --config file included."""
    p = args if isinstance(args, Passthrough) else read_passthrough(args, table)
    v = p.resolve(table or FALLBACK)
    where = f"the engine's {engine_gpus} GPUs (--rollout-num-gpus-per-engine {engine_gpus})"
    dp, attn = as_int(v.get("dp_size"), 1), as_int(v.get("attn_dp_size"), 1)
    dp_attention = v.get("enable_dp_attention") is not None and v["enable_dp_attention"].value not in (False, None)
    if dp > 1 and attn > 1:
        raise ConfigError(f"{v['dp_size'].said} with {v['attn_dp_size'].said}: SGLang runs no "
                          "data-parallel replicas beside attention data parallelism")
    if dp > 1 and not dp_attention:
        raise ConfigError(f"{v['dp_size'].said} without attention data parallelism starts {dp} copies of "
                          f"the model in each engine, {dp * engine_gpus} GPUs, but each engine has {engine_gpus}: "
                          "run more engines instead, or make it attention data-parallel within the engine "
                          f"(--sglang-attn-dp-size {dp}; SGLang 0.5.14: add --sglang-enable-dp-attention)")
    for dest, what in (("attn_dp_size", "attention data-parallel size"), ("dp_size", "attention data-parallel size"),
                       ("ep_size", "expert-parallel size"), ("moe_dense_tp_size", "dense-layer TP size")):
        s = v.get(dest)
        n = as_int(s, 1)
        if s is not None and (n < 1 or engine_gpus % n):
            raise ConfigError(f"{s.said}: the {what} must divide {where}")
