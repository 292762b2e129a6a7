"""Make every file path of a settings layer absolute, before anything checks or stores it.

The job runs in the run directory, not where `rlslurm submit` was typed, so a relative path that
passed the submit-side checks would name another file (or none) in the job. Bases:
* flags: the submitting process's working directory;
* `--config run.yaml`: the YAML file's directory (a config kept beside its data stays valid
  wherever it is submitted from).
`--sglang-config FILE` (SGLang's own YAML of flags) likewise. `~` is expanded (a YAML value never passes through a
shell). Symlinks are kept as written: on clusters `/home` is often a link into the parallel file system and users
recognise their path.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from rlslurm.settings.flags import Layer

# Fields holding one local path.
PATH_FIELDS = ("run_dir", "setup_script", "hf_checkpoint", "ref_load", "load", "prompt_data",
               "load_debug_rollout_data", "apptainer_image", "python", "eval_config", "wandb_dir", "save_hf",
               "save_debug_train_data", "export_retired_rollouts")
# Plugin specs: `module.path:attr` stays as is, `path/to/file.py:attr` gets an absolute file.
PLUGIN_FIELDS = ("custom_rm_path", "custom_generate_function_path", "rollout_function_path",
                 "dynamic_sampling_filter_path", "buffer_filter_path", "data_source_path", "custom_loss_function_path",
                 "custom_advantage_function_path", "rollout_sample_filter_path", "custom_reward_post_process_path",
                 "custom_tis_function_path")


def absolute(p: Any, base: Path) -> str:
    return os.path.abspath(os.path.join(base, os.path.expanduser(str(p))))


def is_file_plugin(spec: str) -> bool:
    target = spec.rpartition(":")[0]
    return target.endswith(".py") or "/" in target


def _plugin(spec: Any, base: Path) -> Any:
    if not isinstance(spec, str) or ":" not in spec or not is_file_plugin(spec):
        return spec  # a module spec, or malformed: the plugin loader names the flag
    target, _, attr = spec.rpartition(":")
    return f"{absolute(target, base)}:{attr}"


def _model(name: Any, base: Path) -> Any:
    # `--model` is a config name or a path to a model YAML (model_config.load_model_config).
    if isinstance(name, str) and name.endswith((".yaml", ".yml")):
        return absolute(name, base)
    return name


def _one(name: str, value: Any, base: Path) -> Any:
    if value is None or value == "":
        return value
    if name == "python":
        # a bare command name (`python3`) is looked up on the node's PATH: not a path
        return absolute(value, base) if "/" in str(value) else value
    if name == "apptainer_image" and "://" in str(value):
        return value  # docker://..., library://...: not a local file
    if name in PATH_FIELDS:
        return absolute(value, base)
    if name in PLUGIN_FIELDS:
        return _plugin(value, base)
    if name == "model":
        return _model(value, base)
    if name == "eval_prompt_data" and isinstance(value, list):
        # NAME PATH pairs: every second item is a path
        return [absolute(v, base) if i % 2 else v for i, v in enumerate(value)]
    return value


def absolutize(layer: Layer, base: Path) -> Layer:
    """Rewrite the layer's path values in place against `base`; returns the layer."""
    base = Path(os.path.abspath(base))
    for key, value in list(layer.values.items()):
        layer.values[key] = _one(key[1], value, base)
    layer.sglang_args[:] = _sglang_config(layer.sglang_args, base)
    return layer


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def hub_id_of(path: Path) -> str | None:
    """The Hugging Face Hub id a path that does not exist reads like ("THUDM/GLM-4-9B-0414" given as a
    path, made absolute here): its last two components, when neither exists and they are not a
    directory under the root (`/ckpt/Qwen3-4B` is a path); else None."""
    hub_id = f"{path.parent.name}/{path.name}"
    if path.exists() or path.parent.exists() or path.parent.parent == Path(path.anchor) \
            or not _HUB_ID.fullmatch(hub_id):
        return None
    return hub_id


def model_download_hint(path: Path, flag: str) -> str:
    """How to get the model a --hf-checkpoint (or --ref-load) that reads like a Hub id names: the nodes
    read local files only. '' when the path does not read like one."""
    hub_id = hub_id_of(path)
    if hub_id is None:
        return ""
    local = f"models/{path.name}"
    return (f"; if {hub_id!r} is a Hugging Face Hub model, download it first (the nodes read local files only): "
            f"hf download {hub_id} --local-dir {local}, then {flag} {local} (its safetensors are read as they are: "
            f"no conversion)")


def _sglang_config(args: list[str], base: Path) -> list[str]:
    """`--sglang-config FILE` (SGLang's YAML of flags, read on the rollout node): an absolute FILE."""
    out = list(args)
    for i, a in enumerate(out):
        if a == "--config" and i + 1 < len(out) and not out[i + 1].startswith("--"):
            out[i + 1] = absolute(out[i + 1], base)
        elif a.startswith("--config="):
            out[i] = "--config=" + absolute(a.split("=", 1)[1], base)
    return out
