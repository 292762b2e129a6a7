"""The `--sglang-*` passthrough read as the engine will read it: its `--config FILE` expanded the way
SGLang merges it, every flag resolved to what SGLang's argparse makes of it (aliases, `--x=v`,
abbreviations, the last occurrence wins), so that submit's checks and the rollout node's judge the
values the engine will run with, not the spelling the user chose.

SGLang 0.5.23 (sglang/srt/server_args.py `prepare_server_args`, utils/server_args_config_parser.py
`ConfigArgumentMerger`): `--config FILE` names a YAML mapping (suffix .yaml/.yml) whose keys become
`--<key>` flags placed before the command line, so the command line wins; a true value of a
store_true flag becomes the bare flag, a false one nothing; any other bool `--key true|false`; a list
`--key item ...`; a mapping its JSON; a key of a flag taking several values or none (other than
store_true) is refused. Its argparse allows unique prefixes of a flag (`--attn-dp 2` is `--attn-dp-size
2`).

The parser's table (every option string: its dest, how many values it takes, its constant, how a config
key may set it) comes from the installed SGLang (engines/sglang_flags.py `sglang_parser_table`); where
SGLang is not installed (a submit host of another environment) `FALLBACK` stands in for the flags the
checks judge, and the rollout node checks again with its own SGLang before it starts an engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlslurm.errors import ConfigError

# option string -> [dest, nargs, constant (nargs 0), config kind]; nargs as argparse's (None: one value,
# 0: none, "?", "*", "+", or a count); config kind: "store_true", "one" or "unsupported"
Table = dict[str, list[Any]]

CONFIG_FLAG = "--config"


def _one(dest: str) -> list[Any]:
    return [dest, None, None, "one"]


# The flags the checks judge, with SGLang 0.5.23's aliases: where no SGLang is installed to ask.
FALLBACK: Table = {
    **{o: _one("model_path") for o in ("--model-path", "--model")},
    "--host": _one("host"), "--port": _one("port"), "--nccl-port": _one("nccl_port"),
    "--base-gpu-id": _one("base_gpu_id"), "--api-key": _one("api_key"), "--device": _one("device"),
    "--dtype": _one("dtype"), "--nnodes": _one("nnodes"), "--node-rank": _one("node_rank"),
    **{o: _one("tp_size") for o in ("--tp-size", "--tensor-parallel-size")},
    **{o: _one("dist_init_addr") for o in ("--dist-init-addr", "--nccl-init-addr")},
    **{o: _one("dp_size") for o in ("--dp-size", "--data-parallel-size")},
    **{o: _one("attn_dp_size") for o in ("--attn-dp-size", "--attention-data-parallel-size")},
    "--enable-dp-attention": ["enable_dp_attention", 0, True, "unsupported"],
    "--dwdp-size": _one("dwdp_size"), "--ep-join-mode": _one("ep_join_mode"),
    **{o: _one("ep_size") for o in ("--ep-size", "--expert-parallel-size", "--ep")},
    "--moe-dense-tp-size": _one("moe_dense_tp_size"), "--quantization": _one("quantization"),
    "--moe-runner-backend": _one("moe_runner_backend"), "--mem-fraction-static": _one("mem_fraction_static"),
    CONFIG_FLAG: _one("config"),
}


@dataclass(frozen=True)
class Setting:
    """One resolved value and where it came from, in the user's terms."""

    value: Any
    source: str   # "--sglang-attn-dp-size" or "key attn-dp-size of --sglang-config /x.yaml"
    flag: str     # the SGLang option it resolved to ("--attn-dp-size")

    @property
    def said(self) -> str:
        """The setting as the user wrote it: `--sglang-attn-dp-size 2`, `--sglang-enable-dp-attention`,
        `attn-dp-size: 2 in --sglang-config /x.yaml`."""
        if self.source.startswith("key "):
            key, _, config = self.source[4:].partition(" of ")
            return f"{key}: {self.value} in {config}"
        return self.source if self.value is True or self.value == "" else f"{self.source} {self.value}"


@dataclass
class Passthrough:
    """A passthrough argv as SGLang will parse it."""

    cli: list[str]                       # the argv without its --config FILE
    config: Path | None = None           # the --config file, when there is one
    from_config: list[str] = field(default_factory=list)  # the flags it stands for, in SGLang's expansion

    @property
    def argv(self) -> list[str]:
        """What SGLang's argparse parses: the config's flags first, so that the command line wins."""
        return [*self.from_config, *self.cli]

    def flags(self) -> list[tuple[str, str]]:
        """(flag as SGLang sees it, how the user wrote it) of every flag, config keys first."""
        out = [(t.split("=", 1)[0], f"key {t[2:].split('=', 1)[0]} of --sglang-config {self.config}")
               for t in self.from_config if t.startswith("--")]
        return out + [(t.split("=", 1)[0], "--sglang-" + t[2:].split("=", 1)[0]) for t in self.cli
                      if t.startswith("--")]

    def resolve(self, table: Table) -> dict[str, Setting]:
        """dest -> its value as argparse would leave it (only the dests set here)."""
        out: dict[str, Setting] = {}
        for tokens, config in ((self.from_config, True), (self.cli, False)):
            i = 0
            while i < len(tokens):
                tok = tokens[i]
                i += 1
                if not tok.startswith("--"):
                    continue  # a stray value: SGLang refuses it, and the unknown-flag check names it
                name, eq, inline = tok.partition("=")
                opt = match_option(name, table)
                if opt is None:
                    continue
                dest, nargs, const, _ = table[opt]
                if nargs == 0:
                    value: Any = const
                elif eq:
                    value = inline
                else:
                    j = i
                    while j < len(tokens) and not tokens[j].startswith("--"):
                        j += 1
                    values = tokens[i:j]
                    if nargs in (None, "?"):
                        value, i = (values[0], i + 1) if values else (const if nargs == "?" else "", i)
                    else:
                        value, i = values, j
                source = (f"key {name[2:]} of --sglang-config {self.config}" if config
                          else "--sglang-" + name[2:])
                out[dest] = Setting(value, source, opt)
        return out


def match_option(name: str, table: Table) -> str | None:
    """The option `name` stands for, as argparse (allow_abbrev) finds it: itself, or the one option it
    is a prefix of; None for no option or an ambiguous prefix (SGLang refuses both)."""
    if name in table:
        return name
    hits = [o for o in table if o.startswith(name)] if len(name) > 2 else []
    return hits[0] if len(hits) == 1 else None


def read_passthrough(args: list[str] | tuple[str, ...], table: Table | None = None) -> Passthrough:
    """`args` with its --config FILE expanded as SGLang expands it (`table`: how the installed
    SGLang's flags take config keys; None: FALLBACK's). A bad config file is one line naming it."""
    args = list(args)
    at = [i for i, a in enumerate(args) if a == CONFIG_FLAG or a.startswith(CONFIG_FLAG + "=")]
    if not at:
        return Passthrough(args)
    if len(at) > 1:
        raise ConfigError("--sglang-config given twice: SGLang takes one config file")
    i = at[0]
    if args[i] == CONFIG_FLAG:
        if i + 1 >= len(args) or args[i + 1].startswith("--"):
            raise ConfigError("--sglang-config needs a YAML file")
        path, rest = args[i + 1], args[:i] + args[i + 2:]
    else:
        path, rest = args[i].split("=", 1)[1], args[:i] + args[i + 1:]
    config = Path(path)
    return Passthrough(rest, config, config_flags(config, table or FALLBACK))


def config_flags(path: Path, table: Table) -> list[str]:
    """The flags SGLang's ConfigArgumentMerger makes of YAML file `path` (module docstring)."""
    import json

    import yaml

    where = f"--sglang-config {path}"
    if path.suffix.lower() not in (".yaml", ".yml"):
        raise ConfigError(f"{where}: SGLang takes only a .yaml or .yml file")
    try:
        text = path.read_bytes().decode()
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not a text file ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{where}: cannot read it: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: invalid YAML: {' '.join(str(e).split())}") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: the top level must be a mapping of SGLang flags")
    by_key: dict[str, str] = {}
    for opt, (dest, *_rest) in table.items():
        by_key.setdefault(dest, opt)
        by_key.setdefault(opt[2:].replace("-", "_"), opt)
    out: list[str] = []
    for key, value in data.items():
        key = str(key)
        opt = by_key.get(key.replace("-", "_"))
        kind = table[opt][3] if opt is not None else "one"
        if kind == "unsupported":
            raise ConfigError(f"{where}: key {key}: SGLang does not take {opt} from a config file")
        if isinstance(value, bool):
            if kind == "store_true":
                out += [f"--{key}"] if value else []
            else:
                out += [f"--{key}", str(value).lower()]
        elif isinstance(value, list):
            out += [f"--{key}", *(str(v) for v in value)] if value else []
        elif isinstance(value, dict):
            out += [f"--{key}", json.dumps(value)]
        else:
            out += [f"--{key}", str(value)]
    return out


def as_int(s: Setting | None, default: int) -> int:
    if s is None or s.value in (None, ""):
        return default
    try:
        return int(s.value)
    except (TypeError, ValueError):
        raise ConfigError(f"{s.said}: not an integer") from None


def attention_dp(values: dict[str, Setting]) -> Setting | None:
    """What turns SGLang's attention data parallelism on (its ZMQ between an engine's processes then
    goes over TCP: engines/span.py), or None. SGLang 0.5.23 runs it when the resolved `attn_dp_size`
    is above 1 (sglang/srt/runtime_context.py `attn_dp_enabled_of`), which `--attn-dp-size N`, the
    deprecated `--enable-dp-attention` with `--dp-size N` (arg_groups/parallel_hook.py
    `handle_deprecated_dp_attention`), `--dwdp-size N` (`handle_dwdp`) and DeepSeek's context-parallel
    layouts' `--dp-size N` (model_override_base.py `context_parallel_attn_dp_size`) set, or an elastic-EP
    scale joiner (`--ep-join-mode scale`). `--enable-dp-attention` alone counts too: older SGLang
    (0.5.14) runs its TCP ports whatever the size."""
    s = values.get("enable_dp_attention")
    if s is not None and s.value not in (False, None, "false", "False"):
        return s
    for dest in ("attn_dp_size", "dwdp_size", "dp_size"):
        if as_int(values.get(dest), 1) > 1:
            return values[dest]
    s = values.get("ep_join_mode")
    return s if s is not None and s.value == "scale" else None
