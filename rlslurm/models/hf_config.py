"""The model config and an HF checkpoint's `config.json`: one relation, three directions.

`arch_from_hf` reads a model config off config.json, `hf_from_arch` writes config.json for a model
config, `check_hf_config` compares the two field by field; all three walk the same table: the rows
every family shares (models/tables.py COMMON) and the family's own (models/families/). The first
mismatch is a ConfigError naming the model-config field, the HF field and both values. HF defaults
(a field absent from config.json) come from transformers' own config class, so a checkpoint that
relies on a default is judged by the value transformers would really use.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Iterator

from rlslurm.errors import ConfigError, DataError, UserError
from rlslurm.models.family import ABSENT, HF, Family, Field, arch_value, family_of, unserved
from rlslurm.models.tables import COMMON
from rlslurm.settings.model_config import ModelConfig

Pair = tuple[str, Any, str, Any]
ROPE_KEYS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "low_freq_factor", "high_freq_factor")


class FileConfig:
    """config.json as written, for a host without transformers (a login node that submits a job running
    another environment: docs/supported-stacks.md). Its keys are attributes (`text_config` a FileConfig
    too); a field the file leaves out is missing here, where transformers would fill in its default, so
    `check_hf_config` leaves the comparisons that need one to the trainer, which runs with transformers."""

    def __init__(self, raw: dict[str, Any]):
        for k, v in raw.items():
            setattr(self, k, FileConfig(v) if k == "text_config" and isinstance(v, dict) else v)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
        except (TypeError, ValueError):
            return False
    return a == b


def _left_out(cfg: FileConfig, hf_field: str) -> bool:
    """Whether a compared HF field (`num_key_value_heads`, `rope_parameters.rope_theta`,
    `n_shared_experts*moe_intermediate_size`) is missing from the file, so that its value would be
    transformers' default; a family's fixed value (`(qwen3_moe router)`) is never."""
    if hf_field.startswith("("):
        return False
    where = [cfg, getattr(cfg, "text_config", None)]
    where += [getattr(c, d, None) for c in where if c is not None for d in ("rope_parameters", "rope_scaling")]
    names = [n for n in re.findall(r"[A-Za-z_]\w*", hf_field) if n != "rope_parameters"]
    return not all(any(n in (vars(c) if isinstance(c, FileConfig) else c)
                       for c in where if isinstance(c, (dict, FileConfig))) for n in names)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_bytes())
    except json.JSONDecodeError as e:
        raise DataError(str(path), f"invalid JSON: {e}") from None
    except UnicodeDecodeError as e:
        raise DataError(str(path), f"not UTF-8 text ({e.reason} at byte {e.start}), so not a config.json") from None
    except OSError as e:
        raise DataError(str(path), f"cannot read it: {e.strerror or e}") from None
    if not isinstance(raw, dict):
        raise DataError(str(path), f"a JSON {type(raw).__name__}, not an object")
    if "model_type" not in raw:
        raise DataError(str(path), "no model_type")
    return raw


def load_hf_config(hf_dir: str | Path):
    """The transformers config object of a checkpoint directory (offline; defaults filled in); where
    transformers is not installed, the file as written (FileConfig). A model type served as an alias
    reads as its family's."""
    try:
        from transformers import AutoConfig
    except ModuleNotFoundError:
        AutoConfig = None

    path = Path(hf_dir) / "config.json"
    if not path.exists():
        raise ConfigError(f"{hf_dir}: no config.json (not an HF checkpoint directory)")
    raw = _read_json(path)
    family = family_of(raw["model_type"])
    alias = family.name if family is not None and family.name != raw["model_type"] else None
    if alias is not None:
        raw = {**raw, "model_type": alias}
    if AutoConfig is None:
        return FileConfig(raw)
    try:
        base = alias or (family.remote_base if family is not None else None)
        if base is not None:
            # without the remote code transformers does not know the type: read the fields with the
            # class the remote one subclasses (an alias: its family's), keeping the family's model_type
            fields = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map")}
            cfg = AutoConfig.for_model(base, **fields)
            cfg.model_type = raw["model_type"]
            return cfg
        # trust_remote_code=False: a type transformers does not know is one line, never a prompt
        # on stdin asking to run the checkpoint's code
        return AutoConfig.from_pretrained(str(hf_dir), local_files_only=True, trust_remote_code=False)
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(str(path), f"transformers cannot read it: {e}") from None


# ---------------------------------------------------------------- the table, walked


def rows(family: Family) -> list[Field]:
    """The family's plain rows: COMMON with the family's replacements in place, then its own."""
    own = {f.arch: f for f in family.fields}
    out = [own.pop(f.arch, f) for f in COMMON]
    return out + list(own.values())


def language_model(family: Family, cfg: Any) -> Any:
    """The part of config.json that describes the language model (a vision-language family's text_config)."""
    return cfg.text_config if family.text_config else cfg


def _rope_pairs(a: Any, rope: dict[str, Any]) -> list[Pair]:
    rtype = rope.get("rope_type", "default")
    if rtype in (None, "default"):
        return [("arch.rope_scaling", a.rope_scaling, "rope_parameters.rope_type", None)]
    rs = a.rope_scaling
    pairs: list[Pair] = [("arch.rope_scaling.type", rs.type if rs else None, "rope_parameters.rope_type", rtype)]
    if rs is not None:
        pairs.append(("arch.rope_scaling.factor", rs.factor, "rope_parameters.factor", rope.get("factor")))
        pairs.append(("arch.rope_scaling.original_max_position_embeddings", rs.original_max_position_embeddings,
                      "rope_parameters.original_max_position_embeddings", rope.get("original_max_position_embeddings")))
        pairs += [(f"arch.rope_scaling.{f}", getattr(rs, f), f"rope_parameters.{f}", rope.get(f))
                  for f in ROPE_KEYS if rope.get(f) is not None]
    return pairs


def _pair(f: Field, a: Any, hf: HF) -> Pair:
    ours = arch_value(a, f.arch)
    return (f"arch.{f.arch}", list(ours) if isinstance(ours, tuple) else ours, f.hf, f.value(hf))


def _block_pairs(family: Family, a: Any, hf: HF) -> Iterator[Pair]:
    for block in family.blocks:
        sub = getattr(a, block.arch)
        present = block.present(hf)
        yield (f"arch.{block.arch}", "set" if sub else None, block.hf, "set" if present else None)
        if sub and present:
            yield from (_pair(f, a, hf) for f in block.fields if f.compared)
    have = {b.arch for b in family.blocks}
    for part, says in ABSENT.items():
        if part not in have and getattr(a, part) is not None:
            yield (f"arch.{part}", "set", f"({family.name} {says})", None)


def identity_pairs(mc: ModelConfig, cfg: Any) -> list[Pair]:
    """Which model the checkpoint is: model_type, and architectures where the file names any."""
    pairs: list[Pair] = [("hf_model_type", mc.hf_model_type, "model_type", cfg.model_type)]
    archs = getattr(cfg, "architectures", None)
    if mc.hf_architecture not in (archs or [mc.hf_architecture]):
        pairs.append(("hf_architecture", mc.hf_architecture, "architectures", archs))
    return pairs


def expected_pairs(mc: ModelConfig, cfg: Any, *, family: bool = True) -> list[Pair]:
    """(model-config field, its value, HF field, HF value) for every math-changing field; `family=False`:
    only the plain rows (sizes, norms, rope), without the family's blocks, refusals and fixed fields."""
    fam = family_of(cfg.model_type)
    a = mc.arch
    hf = HF(language_model(fam, cfg), mc.name, cfg.model_type)
    pairs = identity_pairs(mc, cfg) + [_pair(f, a, hf) for f in rows(fam) if f.compared] + _rope_pairs(a, hf.rope)
    if not family:
        return pairs
    if "sliding_attention" in (hf("layer_types") or []):
        # Qwen2/Qwen3 configs can switch on sliding-window layers (use_sliding_window); the
        # Megatron model attends over the whole sequence. Released Qwen2.5/Qwen3 checkpoints keep it off.
        raise ConfigError(f"{mc.name}: HF config has sliding-window attention layers (use_sliding_window), "
                          "which the Megatron model does not implement")
    if fam.refuse is not None:
        fam.refuse(hf)
    pairs += list(_block_pairs(fam, a, hf))
    pairs += [(f"arch.{k}", getattr(a, k), f"({fam.name} architecture)", v) for k, v in fam.fixed.items()]
    return pairs


def check_hf_config(mc: ModelConfig, hf_dir: str | Path) -> list[str]:
    """Raise ConfigError naming the first field where `mc` and `hf_dir/config.json` disagree. Returns what
    was not compared: nothing with transformers; without it (FileConfig) the fields config.json leaves out,
    whose values would be transformers' defaults, or the family's fields when its rules need a field
    transformers derives. model_type and architectures are always compared."""
    cfg = load_hf_config(hf_dir)
    if family_of(cfg.model_type) is None:
        raise ConfigError(unserved(cfg.model_type, f"{hf_dir}/config.json"))
    file_only = isinstance(cfg, FileConfig)
    unchecked: list[str] = []
    try:
        pairs = expected_pairs(mc, cfg)
    except (UserError, TypeError):
        if not file_only:
            raise
        # the family's own rules read fields transformers derives (layer_types from full_attention_interval,
        # mlp_layer_types from first_k_dense_replace, ...): without it they cannot be told here
        unchecked.append(f"the {cfg.model_type} family's own fields (its rules read what transformers derives)")
        try:
            pairs = expected_pairs(mc, cfg, family=False)
        except TypeError:  # a size the others are computed from is left out
            pairs = identity_pairs(mc, cfg)
    for field, ours, hf_field, theirs in pairs:
        if file_only and _left_out(cfg, hf_field):
            unchecked.append(hf_field)  # transformers' default, which the trainer compares
        elif not _same(ours, theirs):
            raise ConfigError(
                f"model config {mc.name!r} does not match {hf_dir}/config.json: "
                f"{field}={ours!r} but HF {hf_field}={theirs!r}"
            )
    return unchecked


# ---------------------------------------------------------------- config.json -> Arch, Arch -> config.json


def _put(arch: dict[str, Any], path: str, value: Any) -> None:
    *outer, last = path.split(".")
    for part in outer:
        arch = arch.setdefault(part, {})
    arch[last] = value


def arch_from_hf(family: Family, cfg: Any, name: str) -> dict[str, Any]:
    """The Arch fields (a dict for ModelConfig's `arch`) that config.json `cfg` describes; a layer pattern
    the model config cannot say is a ConfigError."""
    hf = HF(language_model(family, cfg), name, cfg.model_type)
    arch: dict[str, Any] = {}
    for f in rows(family):
        _put(arch, f.arch, f.value(hf))
    rtype = hf.rope.get("rope_type", "default")
    if rtype not in (None, "default"):
        keys = ("factor", "original_max_position_embeddings", *ROPE_KEYS)
        arch["rope_scaling"] = {"type": rtype, **{k: hf.rope[k] for k in keys if hf.rope.get(k) is not None}}
    for block in family.blocks:
        if block.present(hf):
            for f in block.fields:
                _put(arch, f.arch, f.value(hf))
    arch.update(family.fixed)
    return arch


def hf_from_arch(mc: ModelConfig, **extra: Any) -> dict[str, Any]:
    """The HF config.json of a model config's architecture, as the family's releases write it; `extra`
    keys (token ids) join the language model's fields."""
    family = family_of(mc.hf_model_type)
    if family is None:
        raise ConfigError(unserved(mc.hf_model_type, f"model config {mc.name}"))
    a = mc.arch
    cfg: dict[str, Any] = {"architectures": [mc.hf_architecture], "model_type": mc.hf_model_type}
    for f in rows(family):
        cfg.update(f.entries(a))
    if a.rope_scaling is not None:
        rs = a.rope_scaling.model_dump(exclude_none=True)
        cfg["rope_scaling"] = {"rope_type": rs.pop("type"), **rs}
    for block in family.blocks:
        if getattr(a, block.arch) is not None:
            for f in block.fields:
                cfg.update(f.entries(a))
    cfg.update(extra)
    if family.to_hf is not None:
        cfg = family.to_hf(mc, cfg)
    if not family.text_config:
        return cfg
    text = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    return {"architectures": cfg["architectures"], "model_type": cfg["model_type"], "text_config": text,
            "tie_word_embeddings": a.tie_word_embeddings}
