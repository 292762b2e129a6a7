"""Command-line flags and YAML files -> a validated `RunConfig`.

Every leaf field of `RunConfig` is a flag `--<field-name>`. Values are coerced by pydantic;
errors name where the bad value came from: the flag, `file.yaml:line`, or the model config.
"""

from __future__ import annotations

import difflib
import json
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from rlslurm.errors import ConfigError
from rlslurm.settings.config import SECTIONS, RunConfig
from rlslurm.settings.slime_flags import SLIME_ALIASES, SLIME_ALWAYS, slime_instead

SGLANG_PREFIX = "--sglang-"
ROUTER_PREFIX = "--router-"    # sglang-router's own flags (rlslurm/engines/router.py)
MEGATRON_PREFIX = "--megatron-"


def _fields() -> dict[str, tuple[str, Any]]:
    """field name -> (section, annotation) for every leaf field."""
    out: dict[str, tuple[str, Any]] = {}
    for section in SECTIONS:
        model: type[BaseModel] = RunConfig.model_fields[section].default_factory  # type: ignore[assignment]
        for name, f in model.model_fields.items():
            assert name not in out, f"field {name} defined twice"
            # A field flag must not fall into a passthrough family.
            assert not name.startswith(("sglang_", "megatron_")), f"field {name} collides with a passthrough prefix"
            out[name] = (section, f.annotation)
    return out


FIELDS = _fields()


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


@dataclass(frozen=True)
class FlagHelp:
    """One run flag as `rlslurm flags` shows it; the description is the config field's (rlslurm/settings/config.py)."""

    flag: str
    field: str
    section: str
    type: str
    default: Any
    description: str


def type_name(annotation: Any) -> str:
    """A field's type in flag terms: `int`, `path`, `a|b` for a choice, `str ...` for a list."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return "|".join(str(a) for a in typing.get_args(annotation))
    if origin is list:
        return f"{type_name(args[0])} ..."
    if origin is dict:
        return "KEY=VALUE ... | JSON"
    if args and len(args) == 1 and origin is not None:  # X | None: optional, same type
        return type_name(args[0])
    if annotation is Path:
        return "path"
    return getattr(annotation, "__name__", str(annotation))


def flag_help(keyword: str | None = None) -> list[FlagHelp]:
    """Every run flag with its section, type, default and description; with `keyword`, those whose
    flag or section contains it or whose description has it as a word (case-insensitive; a leading
    `--` and `_` for `-` are accepted, so `--rollout_top_k` finds --rollout-top-k)."""
    defaults = RunConfig()
    key = (keyword or "").strip().lstrip("-").replace("_", "-").lower()
    word = re.compile(rf"(?<![\w-]){re.escape(key)}(?![\w-])", re.I) if key else None
    out = []
    for name, (section, annotation) in FIELDS.items():
        f = flag_name(name)
        info = type(getattr(defaults, section)).model_fields[name]
        h = FlagHelp(f, name, section, type_name(annotation), getattr(getattr(defaults, section), name),
                     info.description or "")
        if word is None or key in f[2:] or key == section or word.search(h.description):
            out.append(h)
    return out


def _kind(annotation: Any) -> str:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = typing.get_origin(annotation)
    if annotation is bool or (args and all(a is bool for a in args)):
        return "bool"
    if base is list or any(typing.get_origin(a) is list for a in args):
        return "list"
    if base is dict or any(typing.get_origin(a) is dict for a in args):
        return "dict"
    return "scalar"


@dataclass
class Layer:
    """One source of settings: values by (section, field) and where each came from."""

    values: dict[tuple[str, str], Any] = field(default_factory=dict)
    origin: dict[tuple[str, str], str] = field(default_factory=dict)
    megatron: dict[str, Any] = field(default_factory=dict)
    sglang_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)

    def set(self, name: str, value: Any, origin: str) -> None:
        if name not in FIELDS:
            raise ConfigError(f"{origin}: unknown setting {name!r}{_suggest(name)}")
        key = (FIELDS[name][0], name)
        self.values[key] = value
        self.origin[key] = origin


def _suggest(name: str) -> str:
    instead = slime_instead(name)
    if instead:
        return f" (a slime flag rlslurm does not have: {instead})"
    if name in SLIME_ALIASES:  # a YAML key: aliases are command-line spellings
        field_name, value = SLIME_ALIASES[name]
        return f" (slime's spelling of {field_name}" + ("" if value is None else f": {value}") + ")"
    _, dot, leaf = name.rpartition(".")
    if dot:  # a YAML path written as a flag (--train.lr): flags name the field alone
        if leaf in FIELDS:
            return f" (flags are not dotted: {flag_name(leaf)}; in a --config YAML: {FIELDS[leaf][0]}: {{{leaf}: ...}})"
        return _suggest(leaf)
    close = difflib.get_close_matches(name, list(FIELDS), n=1)
    return f" (did you mean {flag_name(close[0])}?)" if close else ""


def parse_flags(argv: list[str]) -> Layer:
    """Parse `--field value` flags plus the sglang/megatron passthrough families."""
    layer = Layer()
    i = 0
    while i < len(argv):
        tok = argv[i]
        if not tok.startswith("--"):
            raise ConfigError(f"unexpected argument {tok!r} (flags look like --name value)")
        if tok.startswith(SGLANG_PREFIX):
            i = _passthrough_flag(layer.sglang_args, argv, i, several=True)
        elif tok.startswith(ROUTER_PREFIX):
            i = _passthrough_flag(layer.router_args, argv, i)
        elif tok.startswith(MEGATRON_PREFIX):
            i = _megatron_flag(layer, argv, i)
        else:
            i = _field_flag(layer, argv, i)
    return layer


BOOL_WORDS = ("true", "false", "1", "0", "yes", "no")  # what a bool flag takes as its value


@dataclass(frozen=True)
class _Flag:
    """The flag at argv[at]: `--name`, or `--name=inline` (`eq`)."""

    name: str
    eq: bool
    inline: str
    at: int

    @classmethod
    def read(cls, argv: list[str], i: int) -> _Flag:
        name, eq, inline = argv[i][2:].partition("=")
        return cls(name, bool(eq), inline, i)

    def next_is_value(self, argv: list[str]) -> bool:
        """The token after the flag is no flag: it may be the flag's value."""
        return self.at + 1 < len(argv) and not argv[self.at + 1].startswith("--")


def _passthrough_flag(args: list[str], argv: list[str], i: int, *, several: bool = False) -> int:
    """--sglang-X / --router-X [value]: handed on as --X with its value, if any; `several` (SGLang's):
    every value up to the next flag, as SGLang has flags of several (--cuda-graph-bs-decode 1 2 4) - how
    many each takes is checked against SGLang's parser at submit (preflight.py). Returns the index after
    what it took."""
    flag = _Flag.read(argv, i)
    args.append("--" + flag.name.split("-", 1)[1])
    if flag.eq:
        args.append(flag.inline)
    elif several:
        while i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            args.append(argv[i + 1])
            i += 1
    elif flag.next_is_value(argv):
        args.append(argv[i + 1])
        i += 1
    return i + 1


def _megatron_flag(layer: Layer, argv: list[str], i: int) -> int:
    """--megatron-X [value]: a megatron setting, its value read as YAML; alone, True. Returns the
    index after what it took."""
    flag = _Flag.read(argv, i)
    key = flag.name[len("megatron-"):].replace("-", "_")
    if flag.eq or flag.next_is_value(argv):
        raw = flag.inline if flag.eq else argv[i + 1]
        i += 0 if flag.eq else 1
        layer.megatron[key] = _yaml_value(raw, f"--megatron-{flag.name[len('megatron-'):]}") if raw else raw
    else:
        layer.megatron[key] = True
    return i + 1


def _field_flag(layer: Layer, argv: list[str], i: int) -> int:
    """--<field> [value]: a RunConfig field, by its own flag, --no-<field> (a bool), or slime's spelling
    of it (rlslurm/settings/slime_flags.py). Returns the index after what it took."""
    flag = _Flag.read(argv, i)
    field_name = flag.name.replace("-", "_")
    negated = False
    switch: Any = None
    if field_name in SLIME_ALIASES and field_name not in FIELDS:
        field_name, switch = SLIME_ALIASES[field_name]  # slime's spelling of the same setting
    if field_name in SLIME_ALWAYS and field_name not in FIELDS:  # slime's switch for what rlslurm always does
        if not flag.eq and flag.next_is_value(argv) and argv[i + 1].lower() in BOOL_WORDS:
            i += 1
        return i + 1
    if field_name not in FIELDS and field_name.startswith("no_") and field_name[3:] in FIELDS:
        field_name, negated = field_name[3:], True
    if field_name not in FIELDS:
        raise ConfigError(f"unknown flag --{flag.name}{_suggest(field_name)}")
    kind = _kind(FIELDS[field_name][1])
    origin = (f"--{flag.name}" if switch is not None or flag.name.replace("-", "_") in SLIME_ALIASES
              else flag_name(field_name))
    if switch is not None:
        value: Any = switch  # a switch: takes no value
    elif kind == "bool":
        value, i = (False, i) if negated else _bool_value(flag, argv)
    elif kind == "list":
        value, i = _list_value(layer, flag, argv, field_name, origin)
    elif kind == "dict":
        value, i = _dict_value(layer, flag, argv, field_name, origin)
    else:
        value, i = _scalar_value(flag, argv, origin)
    layer.set(field_name, value, origin)
    return i + 1


# Each `_*_value` returns a field flag's value and the index of the last token it took.


def _bool_value(flag: _Flag, argv: list[str]) -> tuple[Any, int]:
    if flag.eq:
        return flag.inline, flag.at
    if flag.next_is_value(argv) and argv[flag.at + 1].lower() in BOOL_WORDS:
        return argv[flag.at + 1], flag.at + 1
    return True, flag.at


def _values_after(flag: _Flag, argv: list[str]) -> tuple[list[str], int]:
    """The inline value, then every token up to the next flag."""
    values = [flag.inline] if flag.eq else []
    i = flag.at
    while i + 1 < len(argv) and not argv[i + 1].startswith("--"):
        values.append(argv[i + 1])
        i += 1
    return values, i


def _list_value(layer: Layer, flag: _Flag, argv: list[str], field_name: str, origin: str) -> tuple[Any, int]:
    value, i = _values_after(flag, argv)
    if not value and i + 1 < len(argv) and field_name.endswith("sbatch_extra"):
        # its values are options themselves: `--sbatch-extra --constraint=h100` would read
        # --constraint as an rlslurm flag
        raise ConfigError(f"{origin} takes one sbatch option after '=': {origin}={argv[i + 1]} (repeat "
                          f"{origin}=... for more)")
    key = (FIELDS[field_name][0], field_name)
    if key in layer.values:  # the flag given again: its values add up
        value = [*layer.values[key], *value]
    return value, i


def _dict_value(layer: Layer, flag: _Flag, argv: list[str], field_name: str, origin: str) -> tuple[Any, int]:
    items, i = _values_after(flag, argv)
    value = _parse_dict(items, origin)
    key = (FIELDS[field_name][0], field_name)
    if key in layer.values:  # the flag given again: its keys add up
        value = merge_dict(layer.values[key], origin, value, origin, flag_name(field_name))
    return value, i


def _scalar_value(flag: _Flag, argv: list[str], origin: str) -> tuple[Any, int]:
    if flag.eq:
        return flag.inline, flag.at
    if flag.next_is_value(argv) or (flag.at + 1 < len(argv) and _is_number(argv[flag.at + 1])):
        return argv[flag.at + 1], flag.at + 1
    raise ConfigError(f"{origin} needs a value")


def _yaml_value(raw: str, origin: str) -> Any:
    """A passthrough value is YAML (`--megatron-foo '[1, 2]'`); a bad one is the flag's error."""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        mark = getattr(e, "problem_mark", None)
        at = f" at column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{origin}: invalid YAML value {raw!r}: {problem}{at}") from None


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def _parse_dict(items: list[str], origin: str) -> dict[str, Any]:
    if len(items) == 1 and items[0].lstrip().startswith("{"):
        try:
            return json.loads(items[0])
        except json.JSONDecodeError as e:
            raise ConfigError(f"{origin}: invalid JSON: {e}") from None
    out: dict[str, Any] = {}
    for it in items:
        k, sep, v = it.partition("=")
        if not sep:
            raise ConfigError(f"{origin}: expected KEY=VALUE or a JSON object, got {it!r}")
        out[k] = v
    return out


def merge_dict(have: Any, have_origin: str, new: Any, new_origin: str, flag: str) -> Any:
    """A dict setting given twice (a repeated flag, a YAML value and a flag): the keys of both, never one
    dropped for the other; a key given with two different values is one line naming both."""
    if not isinstance(have, dict) or not isinstance(new, dict):
        return new  # not a mapping: the field's validation names it
    for k, v in new.items():
        if k in have and have[k] != v:
            both = f"{have[k]!r} ({have_origin}) and {v!r} ({new_origin})"
            raise ConfigError(f"{flag} {k}: given twice with different values, {both}; give it once")
    return {**have, **new}


def _yaml_lines(text: str, path: Path) -> tuple[Any, dict[tuple[str, ...], int]]:
    """Load YAML and remember the line of every mapping key (for error messages)."""
    try:
        node = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    lines: dict[tuple[str, ...], int] = {}

    def walk(n: Any, prefix: tuple[str, ...]) -> None:
        if isinstance(n, yaml.MappingNode):
            for k, v in n.value:
                key = prefix + (str(k.value),)
                lines[key] = k.start_mark.line + 1
                walk(v, key)

    walk(node, ())
    return data, lines


def load_yaml_layer(path: Path) -> Layer:
    """A run YAML: sections (`rollout: {...}`) and/or flat field names; `megatron:`, `sglang_args:`,
    `router_args:`."""
    if not path.exists():
        raise ConfigError(f"--config: {path} does not exist")
    if not path.is_file():
        raise ConfigError(f"--config: {path} is not a file (a YAML file of settings is expected)")
    try:
        text = path.read_text()
    except UnicodeDecodeError as e:
        raise ConfigError(f"--config: {path} is not a text file ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"--config: cannot read {path}: {e.strerror or e}") from None
    data, lines = _yaml_lines(text, path)
    if data is None:
        return Layer()
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    layer = Layer()
    for key, value in data.items():
        where = f"{path}:{lines.get((str(key),), '?')}"
        if key == "megatron":
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: megatron must be a mapping of TransformerConfig fields")
            layer.megatron.update(value)
        elif key in ("sglang_args", "router_args"):
            if not isinstance(value, list):
                raise ConfigError(f"{where}: {key} must be a list of argv strings")
            getattr(layer, key).extend(str(v) for v in value)
        elif key in SECTIONS and (isinstance(value, dict) or key not in FIELDS):
            # `model:` is both a section and a field (the model name): a mapping means the section.
            if value is None:
                continue
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: section {key!r} must be a mapping")
            for name, v in value.items():
                sub = f"{path}:{lines.get((str(key), str(name)), '?')}"
                if name not in FIELDS or FIELDS[name][0] != key:
                    raise ConfigError(f"{sub}: unknown setting {key}.{name}{_suggest(str(name))}")
                layer.set(name, v, sub)
        else:
            layer.set(str(key), value, where)
    return layer


def build_config(layers: list[Layer]) -> RunConfig:
    """Merge layers (later wins) and validate field types, naming the source of a bad value."""
    nested: dict[str, Any] = {s: {} for s in SECTIONS}
    origin: dict[tuple[str, str], str] = {}
    megatron: dict[str, Any] = {}
    sglang: list[str] = []
    router: list[str] = []
    for layer in layers:
        for (section, name), v in layer.values.items():
            if name in nested[section] and _kind(FIELDS[name][1]) == "dict":  # dicts add up across layers
                v = merge_dict(nested[section][name], origin.get((section, name), "?"), v,
                               layer.origin.get((section, name), "?"), flag_name(name))
            nested[section][name] = v
        origin.update(layer.origin)
        megatron.update(layer.megatron)
        sglang.extend(layer.sglang_args)
        router.extend(layer.router_args)
    try:
        return RunConfig.model_validate({**nested, "megatron": megatron, "sglang_args": sglang,
                                         "router_args": router})
    except ValidationError as e:
        err = e.errors()[0]
        loc = tuple(str(x) for x in err["loc"])
        key = (loc[0], loc[1]) if len(loc) >= 2 else None
        where = origin.get(key, flag_name(loc[1]) if key else "config") if key else "config"
        msg = err["msg"].removeprefix("Value error, ")
        raise ConfigError(f"{where}: {msg} (got {err.get('input')!r})") from None
