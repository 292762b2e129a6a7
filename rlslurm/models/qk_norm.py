"""MiniMax-M2's q/k norm: one RMSNorm over all heads' q (k) at once, split over TP by heads.

transformers 5.19's `MiniMaxM2Attention` normalises the whole q projection (num_attention_heads x
head_dim) with one RMSNorm, and the whole k projection (num_key_value_heads x head_dim) with
another, before splitting heads (docs/model-families.md, "MiniMax-M2"). megatron-core's
`qk_layernorm` builds its norm `hidden_size_per_attention_head` wide and applies it to every head
on its own (transformer/attention.py:1280-1298, applied at :1477-1481), which is another function.

`AllHeadsRMSNorm` takes megatron's place as the `q_layernorm` / `k_layernorm` submodule of
`SelfAttention`, which hands it this rank's heads as `[sq, b, heads_local, head_dim]` (or packed
`[t, heads_local, head_dim]`). Under TP each rank holds a contiguous block of query groups
(linear_qkv is split by groups, convert/mapping.py `fuse_qkv`), so its q heads and k heads are a
contiguous slice of HF's, and its slice of the norm weight is the matching contiguous chunk: the
weight is a TP-sharded parameter (`tensor_model_parallel`, `partition_dim` 0, `partition_stride` 1,
as megatron's ColumnParallelLinear weight), which megatron's gradient-norm clipping
(`param_is_not_tensor_parallel_duplicate`), rlslurm's HF load/export (convert/parallel.py
`partition_dim`) and dist-checkpointing (`sharded_state_dict`) all read. Its gradient is complete on
each rank (only this rank's heads use this chunk), so it must not be summed over TP: the model's
TransformerConfig keeps `qk_layernorm` off for it (models/build.py), which is what makes
finalize_model_grads' name rule (distributed/finalize_model_grads.py:354-356) leave it alone.

The mean of squares is over the whole width, so each rank sums the squares of its own heads and the
partial sums are all-reduced over TP, in the forward and again in the backward (`_SumOverTP`).
TP larger than the head count of the norm (k: the KV heads) would leave a rank without a whole head
of its own: refused where the layout is chosen (models/build.py `check_all_heads_qk_norm`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class _SumOverTP(torch.autograd.Function):
    """Sum over the TP group in the forward and in the backward.

    Every rank normalises its heads by the same total, so the total's gradient is the sum of what
    each rank's heads send back to it, and each rank's partial sum receives all of it. (megatron's
    `reduce_from_tensor_model_parallel_region` passes the gradient through unchanged, which is right
    only when every rank computes the same thing after the sum; here each rank continues with
    different heads.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class AllHeadsRMSNorm(torch.nn.Module):
    """RMSNorm over `heads` x head_dim values (all heads of q, or of k), this rank's heads local.

    Built by megatron's `build_module` with `hidden_size` = head_dim, `config`, `eps`; `heads` (the
    total over TP) comes from the layer spec's params. Computes what transformers' MiniMaxM2RMSNorm
    computes on the concatenated heads: the input in fp32, times rsqrt(mean of squares + eps), cast
    back to the input dtype, times the weight."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, *, heads: int, **_: Any):
        super().__init__()
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        tp = int(config.tensor_model_parallel_size)
        if heads % tp:
            raise ValueError(f"AllHeadsRMSNorm: {heads} heads do not split over tensor parallel size {tp}")
        self.eps = eps
        self.width = heads * hidden_size  # the whole norm's width, over every TP rank
        self.tp_group = ps.get_tensor_model_parallel_group() if tp > 1 else None
        self.weight = torch.nn.Parameter(torch.ones(heads // tp * hidden_size, dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=0, stride=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        flat = x.float().flatten(-2)  # [..., heads_local * head_dim], HF's order within the rank's slice
        squares = flat.pow(2).sum(-1, keepdim=True)
        if self.tp_group is not None:
            squares = _SumOverTP.apply(squares, self.tp_group)
        normed = (flat * torch.rsqrt(squares / self.width + self.eps)).to(dtype)
        return (self.weight * normed).view_as(x)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """The weight as a TP-sharded tensor along dim 0 (megatron's default for a module without
        this method would call it replicated, and each rank's chunk would overwrite the others')."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        kw: dict[str, Any] = {}
        if self.tp_group is not None:
            kw["tp_group"] = self.tp_group
        if metadata and metadata.get("dp_cp_group") is not None:
            kw["dp_cp_group"] = metadata["dp_cp_group"]
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0},
                                                   sharded_offsets, **kw)

    def extra_repr(self) -> str:
        return f"local={tuple(self.weight.shape)}, width={self.width}, eps={self.eps}"
