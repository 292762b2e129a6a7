"""Weights on disk (--weight-sync disk, the fallback of the engine transports, --save-hf):

- `DiskPublisher`: HF safetensors into RUN/weights/v<N>/ (built in a temp directory, renamed into
  place complete), then `Control.set_weight_version(N)`; engines load it with
  `/update_weights_from_disk`. Keeps the newest `keep` versions.

A publisher is called on every trainer rank (the export gathers over TP, ETP and EP, collectives:
convert/export.py says who takes part); only the rank with DP=0, TP=0 of the first pipeline stage
writes (later stages send it their layers, `pipeline.stages_to_first`). The distributed (broadcast)
and IPC publishers implement the same interface (base.py `WeightPublisher`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlslurm.buffer.atomic import fsync_dir, retry_transient
from rlslurm.buffer.control import Control
from rlslurm.buffer.sweep import EXPORT_TMP_PREFIX as TMP_PREFIX
from rlslurm.settings.model_config import ModelConfig
from rlslurm.trainer.weights.record import Delivered


def version_dir(weights_dir: Path, version: int) -> Path:
    return Path(weights_dir) / f"v{version}"


def export_hf(mc: ModelConfig, model: torch.nn.Module, target: Path, *, hf_dir: Path | None = None,
              dtype: torch.dtype | None = None, quantizer: Any = None) -> bool:
    """The model in HF format into `target` (config.json from `hf_dir` or the model config, and its
    tokenizer files): built beside it and renamed into place complete, replacing an older `target`.
    `quantizer` (convert/fp8.py `Fp8Export`, convert/int4.py `Int4Export`): the weights in the FP8 or
    INT4 layout of the checkpoint it was read off, config.json's quantization_config kept, so SGLang
    loads it as it loaded `hf_dir`; None: unquantized tensors, and config.json without a
    quantization_config (--save-hf of a quantized run).
    Collective over the trainer (the export gathers over TP/ETP/EP and PP); returns whether this rank wrote."""
    from megatron.core import parallel_state as ps

    from rlslurm.convert import mcore_to_hf, save_hf_checkpoint
    from rlslurm.convert.parallel import export_roles
    from rlslurm.trainer.pipeline import stages_to_first

    roles = export_roles()
    writer = roles.sender and ps.get_pipeline_model_parallel_rank() == 0
    if roles.exporter:  # every member of every TP/ETP/EP gather (DP 0 and, with experts, the DP ranks they reach)
        stream = mcore_to_hf(mc, model, dtype=dtype)
        if quantizer is not None:  # on each stage's own exporter, before the layers travel to stage 0
            stream = quantizer.quantize(stream)
        stream = stages_to_first(stream, sender=roles.sender)
        if writer:
            target = Path(target)
            tmp = target.parent / f"{TMP_PREFIX}{target.name}-{os.getpid()}"  # buffer/sweep.py removes a killed one's
            shutil.rmtree(tmp, ignore_errors=True)
            target.parent.mkdir(parents=True, exist_ok=True)
            save_hf_checkpoint(stream, tmp, config=hf_config(mc, hf_dir, quantized=quantizer is not None),
                               copy_aux_from=hf_dir)
            if target.exists():  # the same version again after a resume
                shutil.rmtree(target)
            retry_transient(lambda: os.replace(tmp, target), target, "renaming the export into place")
            fsync_dir(target.parent)
        else:
            for _ in stream:
                pass
    dist.barrier()
    return writer


def hf_config(mc: ModelConfig, hf_dir: Path | None, *, quantized: bool = False) -> dict:
    """config.json of an export: `hf_dir`'s, whose quantization_config stays only if the tensors
    written are quantized the same way (`quantized`)."""
    if hf_dir is not None and (Path(hf_dir) / "config.json").exists():
        cfg = json.loads((Path(hf_dir) / "config.json").read_text())
        if not quantized:
            cfg.pop("quantization_config", None)
        return cfg
    from rlslurm.tiny import hf_config_dict

    return hf_config_dict(mc)


class DiskPublisher:
    def __init__(self, mc: ModelConfig, weights_dir: Path, control: Control | None, *,
                 hf_dir: Path | None = None, dtype: torch.dtype | None = None, keep: int = 2,
                 quantizer: Any = None):
        """`quantizer`: the engines serve an FP8 or INT4 checkpoint, so the versions are written in
        its layout (`export_hf`)."""
        self.mc, self.weights_dir, self.control = mc, Path(weights_dir), control
        self.hf_dir, self.dtype, self.keep = (Path(hf_dir) if hf_dir else None), dtype, keep
        self.quantizer = quantizer

    def publish(self, model: torch.nn.Module, version: int, *, record: bool = True) -> Delivered:
        """`record`: write control/weight_version.json (the driver then loads the files); the broadcast
        publisher's fallback records the version itself, once an engine has loaded it."""
        writer = export_hf(self.mc, model, version_dir(self.weights_dir, version), hf_dir=self.hf_dir,
                           dtype=self.dtype, quantizer=self.quantizer)
        if writer:
            self._prune(version)
        if writer and record and self.control is not None:
            self.control.set_weight_version(version, transport="disk")
        return Delivered(version, "disk")

    def _prune(self, newest: int) -> None:
        for p in self.weights_dir.iterdir():
            if p.is_dir() and p.name.startswith("v") and p.name[1:].isdigit() and int(p.name[1:]) <= newest - self.keep:
                shutil.rmtree(p, ignore_errors=True)
