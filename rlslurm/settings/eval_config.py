"""The eval datasets of a run: `--eval-prompt-data NAME PATH ...` or slime's `--eval-config FILE`.

slime's eval config (`slime/utils/eval_config.py`) is a YAML mapping, optionally under `eval:`, with
`defaults` (settings for every dataset) and `datasets` (a list of entries with `name`, or a mapping
name -> entry). A setting comes from the dataset entry, else `defaults`, else the run's flags.
rlslurm reads the keys in `KEYS`; any other slime key is refused with the file and the key, so a
setting is never silently ignored (docs/slime-flags.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rlslurm.errors import ConfigError
from rlslurm.settings.config import RunConfig
from rlslurm.settings.prompt_slice import PromptSpec, parse_prompt_spec
from rlslurm.settings.rm_types import RM_REGISTRY, RM_TYPES

FLAG = "--eval-config"

# key -> the type YAML must give (bool is not accepted for int/float)
KEYS: dict[str, tuple[type, ...]] = {
    "n_samples_per_eval_prompt": (int,), "temperature": (int, float), "top_p": (int, float), "top_k": (int,),
    "max_response_len": (int,), "stop": (list,), "stop_token_ids": (list,),
    "input_key": (str,), "label_key": (str,), "tool_key": (str,), "metadata_key": (str,),
    "apply_chat_template": (bool,), "rm_type": (str,),
}


@dataclass
class EvalDataset:
    name: str
    path: str                      # may carry slime's @[START:END] slice
    n_samples_per_eval_prompt: int
    temperature: float
    top_p: float
    top_k: int
    max_response_len: int
    stop: list[str]
    stop_token_ids: list[int]
    input_key: str
    label_key: str | None
    tool_key: str | None
    metadata_key: str | None
    apply_chat_template: bool
    rm_type: str | None = None     # set as each prompt's metadata rm_type (slime's inject_metadata)


def _from_flags(cfg: RunConfig) -> dict[str, Any]:
    r, d = cfg.rollout, cfg.data
    return {
        "n_samples_per_eval_prompt": r.n_samples_per_eval_prompt,
        # slime samples eval at the rollout temperature unless --eval-temperature is given
        "temperature": r.rollout_temperature if r.eval_temperature is None else r.eval_temperature,
        "top_p": r.eval_top_p if r.eval_top_p is not None else r.rollout_top_p,
        "top_k": r.eval_top_k if r.eval_top_k is not None else r.rollout_top_k,
        "max_response_len": r.eval_max_response_len or r.rollout_max_response_len,
        "stop": list(r.rollout_stop), "stop_token_ids": list(r.rollout_stop_token_ids),
        "input_key": d.input_key, "label_key": d.label_key, "tool_key": d.tool_key, "metadata_key": d.metadata_key,
        "apply_chat_template": d.apply_chat_template, "rm_type": None,
    }


def eval_datasets(cfg: RunConfig) -> list[EvalDataset]:
    """The run's eval datasets, in order; ConfigError (one line, naming the flag or file) if malformed."""
    d = cfg.data
    if d.eval_config is not None and d.eval_prompt_data:
        raise ConfigError(f"{FLAG} and --eval-prompt-data both given: slime uses {FLAG} alone; pass one of them")
    base = _from_flags(cfg)
    if d.eval_config is None:
        pairs = d.eval_prompt_data
        out = [EvalDataset(name=pairs[i], path=pairs[i + 1], **base) for i in range(0, len(pairs), 2)]
        where = "--eval-prompt-data"
    else:
        out = _read(Path(d.eval_config), base, cfg)
        where = f"{FLAG} {d.eval_config}"
    names = [e.name for e in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"{where}: dataset name(s) {dup} given twice")
    return out


def _read(path: Path, base: dict[str, Any], cfg: RunConfig) -> list[EvalDataset]:
    where = f"{FLAG} {path}"
    if not path.is_file():
        raise ConfigError(f"{where}: not a file")
    try:
        root = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML ({' '.join(str(e).split())})") from None
    if not isinstance(root, dict):
        raise ConfigError(f"{where}: the root must be a mapping (with `eval:` or `datasets:`)")
    ev = root.get("eval", root)
    if not isinstance(ev, dict):
        raise ConfigError(f"{where}: `eval` must be a mapping with `datasets` (and optional `defaults`)")
    defaults = ev.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise ConfigError(f"{where}: `defaults` must be a mapping")
    _check_keys(defaults, f"{where}: defaults")
    entries = _entries(ev.get("datasets"), where)
    if not entries:
        raise ConfigError(f"{where}: no datasets under `datasets`")
    out = []
    for i, entry in enumerate(entries):
        at = f"{where}: datasets[{entry.get('name', i)}]"
        name, p = entry.get("name"), entry.get("path")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{at}: needs a `name` (a string)")
        if not isinstance(p, str) or not p:
            raise ConfigError(f"{at}: needs a `path` (a .jsonl or .parquet file)")
        rest = {k: v for k, v in entry.items() if k not in ("name", "path")}
        _check_keys(rest, at)
        # a relative path is the config file's neighbour, as for --config run.yaml (rlslurm/settings/paths.py)
        spec = parse_prompt_spec(p, f"{at} path")
        full = PromptSpec(Path(os.path.abspath(path.parent / os.path.expanduser(spec.path))), spec.start, spec.end)
        ds = EvalDataset(name=name, path=str(full), **{**base, **defaults, **rest})
        _check_rm(ds, at, cfg)
        out.append(ds)
    return out


def _entries(value: Any, where: str) -> list[dict[str, Any]]:
    if value is None:
        return []
    if isinstance(value, dict):  # name -> entry
        out = []
        for name, entry in value.items():
            if entry is not None and not isinstance(entry, dict):
                raise ConfigError(f"{where}: datasets[{name}] must be a mapping")
            out.append({"name": name, **(entry or {})})
        return out
    if isinstance(value, list):
        if not all(isinstance(e, dict) for e in value):
            raise ConfigError(f"{where}: every entry of `datasets` must be a mapping with `name` and `path`")
        return [dict(e) for e in value]
    raise ConfigError(f"{where}: `datasets` must be a list or a mapping")


def _check_keys(entry: dict[str, Any], at: str) -> None:
    for key, value in entry.items():
        if key not in KEYS:
            raise ConfigError(f"{at}: key {key!r} is not read by rlslurm (it reads {', '.join(sorted(KEYS))})")
        want = KEYS[key]
        if value is None and key in ("label_key", "tool_key", "metadata_key", "rm_type"):
            continue
        if not isinstance(value, want) or (isinstance(value, bool) and bool not in want):
            raise ConfigError(f"{at}: {key} must be {' or '.join(t.__name__ for t in want)}, got {value!r}")
    if entry.get("n_samples_per_eval_prompt", 1) < 1 or entry.get("max_response_len", 1) < 1:
        raise ConfigError(f"{at}: n_samples_per_eval_prompt and max_response_len must be >= 1")
    top_k = entry.get("top_k", -1)
    if top_k != -1 and top_k < 1:
        raise ConfigError(f"{at}: top_k must be -1 (no top-k cut) or >= 1")
    if not 0 < entry.get("top_p", 1) <= 1 or entry.get("temperature", 0) < 0:
        raise ConfigError(f"{at}: top_p must be in (0, 1] and temperature >= 0")


def _check_rm(ds: EvalDataset, at: str, cfg: RunConfig) -> None:
    if ds.rm_type is None:
        return
    if cfg.rollout.custom_rm_path or RM_REGISTRY[cfg.rollout.rm_type].needs_url:
        scorer = "--custom-rm-path" if cfg.rollout.custom_rm_path else f"--rm-type {cfg.rollout.rm_type}"
        raise ConfigError(f"{at}: rm_type {ds.rm_type!r} with {scorer}: a record's rm_type picks among the rule "
                          "rewards, and this run's reward is not one (it sees the record's metadata instead)")
    if ds.rm_type not in RM_TYPES or RM_REGISTRY[ds.rm_type].needs_url:
        rules = sorted(n for n in RM_TYPES if not RM_REGISTRY[n].needs_url)
        raise ConfigError(f"{at}: rm_type {ds.rm_type!r} is not a rule a record can pick ({', '.join(rules)})")
