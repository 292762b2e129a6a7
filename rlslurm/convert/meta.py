"""`rlslurm_model.json`: what a Megatron checkpoint written by `rlslurm convert` was built for.

Megatron pads the vocabulary to a multiple of `divisible_by x TP` (rlslurm.models.build.
padded_vocab_size), so the padded size is part of the checkpoint's tensor shapes: a reader at
another TP must build its model with the *recorded* `vocab_size_padded` (any TP that divides it
works), not recompute it. The file also records the architecture, so a checkpoint is never read
into a model config it was not made from.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rlslurm.errors import ConfigError, DataError
from rlslurm.settings.model_config import ModelConfig

META_NAME = "rlslurm_model.json"


def write_meta(ckpt_dir: str | Path, meta: dict[str, Any]) -> None:
    path = Path(ckpt_dir) / META_NAME
    tmp = path.with_name(f".{META_NAME}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(json.dumps(meta, indent=2))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_meta(ckpt_dir: str | Path) -> dict[str, Any]:
    """The recorded metadata, {} for a checkpoint that has none (not written by the converter)."""
    path = Path(ckpt_dir) / META_NAME
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(str(path), f"invalid JSON: {e}") from None


def check_meta(mc: ModelConfig, ckpt_dir: str | Path, tp: int) -> int | None:
    """Refuse a checkpoint of another architecture; return its padded vocabulary (None: unknown)."""
    meta = read_meta(ckpt_dir)
    if not meta:
        return None
    ours, theirs = mc.arch.model_dump(mode="json"), meta.get("arch", {})
    for field in ours:
        # a field added since the checkpoint was written is absent there: it has the field's default
        recorded = theirs[field] if field in theirs else type(mc.arch).model_fields[field].default
        if ours[field] != recorded:
            raise ConfigError(f"model config {mc.name!r}: arch.{field}={ours[field]!r} but the checkpoint "
                              f"{Path(ckpt_dir) / META_NAME} has {recorded!r}")
    vpad = meta.get("vocab_size_padded")
    if vpad is not None and vpad % tp:
        raise ConfigError(f"tensor parallel size {tp} does not divide the checkpoint's padded vocabulary {vpad} "
                          f"({Path(ckpt_dir) / META_NAME}); convert it again with a matching "
                          f"--vocab-divisible-by")
    return vpad
