"""Megatron -> HF export, streamed tensor by tensor (weight sync, converter, HF checkpoint save).

`mcore_to_hf` walks the model's tensors in state-dict order, gathers each over its TP group
(all_gather) and, for routed experts, over the expert-TP group (ETP, which need not be TP) and then
the EP group, converts it to HF layout and yields `(hf_name, full_tensor)`. It holds one gathered
tensor at a time, so the caller decides the bucketing (weight sync) or the sharding of files
(converter).

Who takes part and who receives: every member of each of those groups must iterate the generator
in step, because each tensor is an all_gather; `parallel.export_roles()` says which ranks that is
(the first dense DP ranks of the stage that the gathers reach, rlslurm/settings/parallel_grid.py). Every
participating rank receives the full tensors; callers that send or write (the `sender`: DP 0, TP 0
of each pipeline stage) use them, the others just drain the generator. With pipeline parallelism each stage
yields the tensors of its own layers (plus the embedding on the first stage and the final norm
and output layer on the last).
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from rlslurm.convert import mapping, parallel
from rlslurm.errors import ConfigError
from rlslurm.settings.model_config import ModelConfig


def _all_gather(t: torch.Tensor, size: int, group) -> list[torch.Tensor]:
    if size == 1:
        return [t]
    t = t.detach().contiguous()
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t, group=group)
    return parts


def mcore_to_hf(
    mc: ModelConfig,
    model: torch.nn.Module,
    *,
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, full_tensor)` for every tensor of this pipeline stage (see module doc).

    `dtype` casts on the way out (None: the parameters' dtype).
    """
    ranks = parallel.Ranks.current()
    tensors = parallel.model_tensors(model)
    l2g = parallel.layer_numbers(model)
    n_local = parallel.num_local_experts(model)
    lay = mapping.Layout.of(mc)
    for name, t in tensors.items():
        res = mapping.resolve(mc, name, layer_map=lambda i: l2g.get(i, i), expert_offset=0)
        if res is None:
            if isinstance(t, torch.nn.Parameter):
                raise ConfigError(f"model config {mc.name}: Megatron parameter {name!r} has no HF mapping")
            continue
        if name == "output_layer.weight" and mc.arch.tie_word_embeddings:
            continue  # tied: the embedding carries it
        pdim = parallel.partition_dim(t)
        if parallel.is_expert(name):
            size, group = ranks.etp_size, ranks.etp_group
        else:
            size, group = ranks.tp_size, ranks.tp_group
        parts = _all_gather(t.data, size, group) if pdim is not None else [t.data]
        full = mapping.unshard(res.rule.kind, parts, partition_dim=pdim, sections=res.rule.sections)
        if parallel.is_expert(name):
            per_ep = _all_gather(full, ranks.ep_size, ranks.ep_group)
            local_idx = res.expert
            items = [(ep * n_local + local_idx, x) for ep, x in enumerate(per_ep)]
        else:
            items = [(res.expert, full)]
        for expert, x in items:
            for pattern, out in zip(res.rule.hf, mapping.to_hf(res.rule, x, lay)):
                out = out.detach()
                if dtype is not None:
                    out = out.to(dtype)
                yield mapping.fmt(pattern, res.layer, expert), out
