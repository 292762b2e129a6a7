"""Load HF safetensors into a (sharded) megatron-core GPTModel, tensor by tensor.

Every rank reads the tensors it needs straight from the safetensors files (memory-mapped, one at a
time) and keeps only its own shard: no rank-0 scatter, so nothing but the file system is shared
and no rank holds a full model. A block-wise FP8 or INT4 W4A16 checkpoint's weights are dequantized as
they are read (convert/fp8.py, convert/int4.py), into float32 and then the model's dtype.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from rlslurm.convert import fp8, hf_io, int4, mapping, parallel
from rlslurm.errors import ConfigError, DataError
from rlslurm.models.hf_config import check_hf_config
from rlslurm.settings.low_precision import stored_precision
from rlslurm.settings.model_config import ModelConfig


def _plan(model: torch.nn.Module, mc: ModelConfig):
    ranks = parallel.Ranks.current()
    tensors = parallel.model_tensors(model)
    local_to_global = parallel.layer_numbers(model)
    n_local = parallel.num_local_experts(model)
    targets: dict[str, int | None] = {}
    override: dict[str, tuple[int, int]] = {}
    for name, t in tensors.items():
        res = mapping.resolve(mc, name, layer_map=lambda i: local_to_global.get(i, i),
                              expert_offset=ranks.ep_rank * n_local)
        if res is None:
            if isinstance(t, torch.nn.Parameter):
                raise ConfigError(f"model config {mc.name}: Megatron parameter {name!r} has no HF mapping "
                                  f"for family {mc.hf_model_type!r}")
            continue  # bookkeeping buffers (token counters), not weights
        targets[name] = parallel.partition_dim(t)
        if parallel.is_expert(name):
            override[name] = (ranks.etp_rank, ranks.etp_size)
    return ranks, tensors, targets, override, local_to_global, n_local


def load_hf_checkpoint(model: torch.nn.Module, mc: ModelConfig, hf_dir: str | Path, *,
                       check_config: bool = True,
                       progress: Callable[[str, int], None] | None = None) -> dict[str, Any]:
    """Copy the HF checkpoint in `hf_dir` into `model` (this rank's shards); returns a summary.

    `config.json` is checked against `mc` first (ConfigError naming the field). Every parameter
    of the model must be covered and every shape must agree (errors name the tensor).
    `progress(name, total)` is called after each tensor (progress bars).
    """
    if check_config:
        check_hf_config(mc, hf_dir)
    ckpt = hf_io.HFCheckpoint(hf_dir)
    # a block-wise FP8 checkpoint is multiplied out on the way in (convert/fp8.py), an INT4 W4A16 one
    # unpacked and scaled (convert/int4.py); their scale tensors are read there and never mapped. Any
    # other quantization is refused here too.
    stored = stored_precision(Path(hf_dir), "HF checkpoint")
    get = (int4.dequantizing(ckpt, stored.int4.group_size) if stored.int4 is not None
           else fp8.dequantizing(ckpt, stored.fp8_block))
    ranks, tensors, targets, override, l2g, n_local = _plan(model, mc)
    emb = tensors.get("embedding.word_embeddings.weight", tensors.get("output_layer.weight"))
    vocab_padded = emb.shape[0] * ranks.tp_size if emb is not None else None
    n = nbytes = 0
    with torch.no_grad():
        for name, local in mapping.hf_to_mcore(
            mc, get, ranks.tp_rank, ranks.tp_size, targets=targets, vocab_size_padded=vocab_padded,
            layer_map=lambda i: l2g.get(i, i), expert_offset=ranks.ep_rank * n_local, tp_override=override,
        ):
            dst = tensors[name]
            if tuple(dst.shape) != tuple(local.shape):
                raise DataError(str(hf_dir), f"Megatron {name} expects shape {tuple(dst.shape)} on this rank, "
                                f"the HF tensor(s) give {tuple(local.shape)} (model config vs checkpoint?)")
            dst.data.copy_(local.to(dst.dtype))
            n += 1
            nbytes += dst.numel() * dst.element_size()
            if progress is not None:
                progress(name, len(targets))
    return {"tensors": n, "bytes": nbytes, "tp_rank": ranks.tp_rank, "ep_rank": ranks.ep_rank}
