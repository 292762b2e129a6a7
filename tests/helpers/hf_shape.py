"""An HF model directory's shape without weights: config.json for a model config and an empty
safetensors file, which is all `rlslurm submit` checks of --hf-checkpoint (rlslurm/preflight.py)."""

from __future__ import annotations

import json
from pathlib import Path

from rlslurm.settings.model_config import load_model_config
from rlslurm.tiny import hf_config_dict


def hf_shaped_dir(path: Path, model: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config_dict(load_model_config(model))))
    (path / "model.safetensors").write_bytes(b"")
    return path
