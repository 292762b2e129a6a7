"""The record of a model family, and the registry of them.

A family is one file under rlslurm/models/families/ that defines `FAMILY = Family(...)`: the HF model
types it serves, what its architecture fixes, its rows of the Arch <-> config.json table, its
weight-mapping rules and its layer-spec hook. Everything that differs between families is read off
these records (models/hf_config.py, models/build.py, convert/mapping.py); adding a family adds a
file here, a model config YAML and its tests (docs/extending.md, "Adding a model family").

Nothing here imports torch or megatron: the login side (`rlslurm submit`, the rollout node) reads
the registry too.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pkgutil
from typing import Any, Callable, Mapping


class HF:
    """config.json as transformers reads it, for the table's rows: `hf(key, default)` is the field
    (the language model's, for a vision-language family), `hf.rope` its rope settings, `hf.name`
    the model named in refusals."""

    def __init__(self, cfg: Any, name: str, model_type: str):
        self.cfg, self.name, self.model_type = cfg, name, model_type
        self.rope = rope_settings(cfg)

    def __call__(self, key: str, default: Any = None) -> Any:
        return getattr(self.cfg, key, default)


def rope_settings(cfg: Any) -> dict[str, Any]:
    """transformers 5 keeps rope settings in `rope_parameters`; 4.x in rope_theta/rope_scaling."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    if "rope_theta" not in params and getattr(cfg, "rope_theta", None) is not None:
        params["rope_theta"] = cfg.rope_theta
    scaling = getattr(cfg, "rope_scaling", None)
    if isinstance(scaling, dict):
        for k, v in scaling.items():
            params.setdefault(k, v)
    if "partial_rotary_factor" not in params and getattr(cfg, "partial_rotary_factor", None) is not None:
        params["partial_rotary_factor"] = cfg.partial_rotary_factor
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params["type"]
    return params


def arch_value(arch: Any, path: str) -> Any:
    """`arch.moe.num_experts` for path "moe.num_experts"."""
    for part in path.split("."):
        arch = getattr(arch, part)
    return arch


@dataclasses.dataclass(frozen=True)
class Field:
    """One row of the Arch <-> config.json table: the Arch field (dotted, "moe.num_experts"), the
    config.json key it is (or, in parentheses, what fixes its value: "(qwen3_moe router)"), how it is
    read (`read`, else the key with `default`) and written (`write`, else {key: value}; a fixed
    row writes nothing). `compared`: check_hf_config compares it (a few rows are only read)."""

    arch: str
    hf: str
    default: Any = None
    read: Callable[[HF], Any] | None = None
    write: Callable[[Any], dict[str, Any]] | None = None
    compared: bool = True

    def value(self, hf: HF) -> Any:
        return self.read(hf) if self.read is not None else hf(self.hf, self.default)

    def entries(self, arch: Any) -> dict[str, Any]:
        if self.write is not None:
            return self.write(arch)
        if not self.hf.isidentifier():
            return {}
        return {self.hf: arch_value(arch, self.arch)}


def fixed(arch: str, why: str, value: Any) -> Field:
    """A row whose value the family's modeling code hard-codes (`why` names it in a mismatch)."""
    return Field(arch, why, read=lambda hf: value)


@dataclasses.dataclass(frozen=True)
class Block:
    """An optional part of the architecture (Arch.moe, .mla, .gated_delta_net, .dsa): the config.json
    key that says it is there (`hf`), whether this config.json has one (`present`), and its rows."""

    arch: str
    hf: str
    fields: tuple[Field, ...]
    present: Callable[[HF], bool] = lambda hf: True


# What a family without the block says when a model config has one (check_hf_config's mismatch)
ABSENT = {"moe": "is dense", "gated_delta_net": "has no linear attention", "mla": "has no MLA",
          "dsa": "has no sparse attention indexer"}


@dataclasses.dataclass(frozen=True, eq=False)  # one record per family: equal is identical
class Family:
    """One model family. `name` is the HF model_type rlslurm builds it as; `aliases` the model
    types of releases that are this architecture under another name (read with this family's config
    class, mapped as it, their auto_map never run); `remote_base` the transformers config class a
    remote-code config class subclasses (read with it; engines need --trust-remote-code).

    `fixed`: Arch fields the modeling code hard-codes (compared, never read from config.json).
    `fields` and `blocks`: the family's rows of the Arch <-> config.json table (models/tables.py
    holds the rows every family shares; a family row with the same Arch field replaces that one).
    `refuse(hf)`: config.json settings the family cannot build, raised as ConfigError.
    `to_hf(mc, cfg)`: the release's config.json beyond the table (switches engines read).
    `layer_rules(mc, layer)`: the weight mapping of one decoder layer (convert/mapping.py Rule).
    `layer_spec(mc, block, tcfg, vp_stage, packed)`: changes to megatron's stock decoder block
    spec (models/build.py), or None.
    `text_config`: a vision-language model whose language model's fields are config.json's
    `text_config` and whose tensors are under `hf_prefix`.
    `checkpoint_extras(out, config_json, hf_config, dtype, seed)`: what a random-init checkpoint of the
    family needs beside what transformers' save_pretrained wrote into `out` (rlslurm/tiny.py): the
    release's extra tensors or files an engine reads at start."""

    name: str
    fixed: Mapping[str, Any]
    layer_rules: Callable[[Any, int], list]
    aliases: tuple[str, ...] = ()
    remote_base: str | None = None
    fields: tuple[Field, ...] = ()
    blocks: tuple[Block, ...] = ()
    refuse: Callable[[HF], None] | None = None
    to_hf: Callable[[Any, dict[str, Any]], dict[str, Any]] | None = None
    layer_spec: Callable[..., None] | None = None
    text_config: bool = False
    hf_prefix: str = "model."
    checkpoint_extras: Callable[[Any, dict[str, Any], Any, Any, int], None] | None = None

    @property
    def model_types(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


# Families looked at and found inexpressible in megatron-core, -> why, for the refusal
# (docs/model-families.md, "Families megatron-core cannot express").
NOT_EXPRESSIBLE: dict[str, str] = {}


@functools.cache
def registry() -> dict[str, Family]:
    """Every HF model_type served -> its Family, from the modules of rlslurm/models/families/."""
    from rlslurm.models import families

    out: dict[str, Family] = {}
    for info in sorted(pkgutil.iter_modules(families.__path__), key=lambda m: m.name):
        family = getattr(importlib.import_module(f"{families.__name__}.{info.name}"), "FAMILY", None)
        if family is None or family.name in out:
            continue
        for model_type in family.model_types:
            if model_type in out:
                raise AssertionError(f"model_type {model_type!r} served by {out[model_type].name} and {family.name}")
            out[model_type] = family
    return out


def family_names() -> tuple[str, ...]:
    """The families, by the model_type each is built as."""
    return tuple(dict.fromkeys(f.name for f in registry().values()))


def family_of(model_type: str | None) -> Family | None:
    """The family serving `model_type` (its own or an alias); None when none does."""
    return registry().get(model_type or "")


def remote_base(model_type: str | None) -> str | None:
    """The transformers model_type whose config class reads `model_type`'s config.json, when its own
    class is remote code (MiMo: qwen2); else None."""
    family = family_of(model_type)
    return family.remote_base if family is not None and model_type == family.name else None


def needs_remote_code(model_type: str | None) -> bool:
    """Whether an engine reads this model_type's config.json only with --trust-remote-code."""
    return remote_base(model_type) is not None


def unserved(model_type: str, where: str) -> str:
    """The one-line refusal of a model_type no family serves."""
    if model_type in NOT_EXPRESSIBLE:
        return f"{where}: model_type={model_type!r} has no mapping: {NOT_EXPRESSIBLE[model_type]}"
    return f"{where}: model_type={model_type!r} has no mapping; supported: {', '.join(family_names())}"
