"""Weight publication after training a rollout: `WeightPublisher.publish(model, version)`.

- `NullPublisher`: replay / train-only runs (no engine listens).
- `DiskPublisher`: HF safetensors into RUN/weights/v<N>/ (built in a temp directory, renamed into
  place complete), then `Control.set_weight_version(N)`; engines load it with
  `/update_weights_from_disk`. Keeps the newest `keep` versions.

A publisher is called on every trainer rank (the export gathers over TP, a collective); only the
rank with DP=0, TP=0 of the first pipeline stage writes (later stages send it their layers,
`pipeline.stages_to_first`). The distributed (broadcast) publisher implements the same interface.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from rlslurm.buffer.atomic import fsync_dir
from rlslurm.buffer.control import Control
from rlslurm.model_config import ModelConfig


class WeightPublisher(Protocol):
    def publish(self, model: torch.nn.Module, version: int) -> None: ...


class NullPublisher:
    def publish(self, model: torch.nn.Module, version: int) -> None:
        return None


def version_dir(weights_dir: Path, version: int) -> Path:
    return Path(weights_dir) / f"v{version}"


class DiskPublisher:
    def __init__(self, mc: ModelConfig, weights_dir: Path, control: Control | None, *,
                 hf_dir: Path | None = None, dtype: torch.dtype | None = None, keep: int = 2):
        self.mc, self.weights_dir, self.control = mc, Path(weights_dir), control
        self.hf_dir, self.dtype, self.keep = (Path(hf_dir) if hf_dir else None), dtype, keep

    def _writer(self) -> bool:
        from megatron.core import parallel_state as ps

        return (ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0
                and ps.get_pipeline_model_parallel_rank() == 0)

    def _config(self) -> dict:
        if self.hf_dir is not None and (self.hf_dir / "config.json").exists():
            return json.loads((self.hf_dir / "config.json").read_text())
        from rlslurm.tiny import hf_config_dict

        return hf_config_dict(self.mc)

    def publish(self, model: torch.nn.Module, version: int) -> None:
        from megatron.core import parallel_state as ps
        from rlslurm.convert import mcore_to_hf, save_hf_checkpoint
        from rlslurm.trainer.pipeline import stages_to_first

        writer = self._writer()
        if ps.get_data_parallel_rank() == 0:  # every TP rank of DP group 0 takes part in the gather
            stream = stages_to_first(mcore_to_hf(self.mc, model, dtype=self.dtype),
                                     sender=ps.get_tensor_model_parallel_rank() == 0)
            if writer:
                final = version_dir(self.weights_dir, version)
                tmp = self.weights_dir / f".tmp-v{version}-{os.getpid()}"
                shutil.rmtree(tmp, ignore_errors=True)
                self.weights_dir.mkdir(parents=True, exist_ok=True)
                save_hf_checkpoint(stream, tmp, config=self._config(), copy_aux_from=self.hf_dir)
                if final.exists():  # re-publication of the same version after a resume
                    shutil.rmtree(final)
                os.replace(tmp, final)
                fsync_dir(self.weights_dir)
                self._prune(version)
            else:
                for _ in stream:
                    pass
        dist.barrier()
        if writer and self.control is not None:
            self.control.set_weight_version(version)

    def _prune(self, newest: int) -> None:
        for p in self.weights_dir.iterdir():
            if p.is_dir() and p.name.startswith("v") and p.name[1:].isdigit() and int(p.name[1:]) <= newest - self.keep:
                shutil.rmtree(p, ignore_errors=True)
