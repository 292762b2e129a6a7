"""Context parallelism (CP > 1) without transformer-engine: rlslurm's own core attention and the
token layout around it (docs/context-parallel.md).

Layout (megatron's load balancing, as `get_batch_on_this_cp_rank` and its rotary embeddings assume):
a sequence of length L (a multiple of 2 x CP) is cut into 2 x CP chunks of c = L / (2 CP) tokens and
CP rank r holds chunks r and 2 CP - 1 - r, in that order, so every rank has the same causal work.
Padded (`bshd`) every row of a micro-batch is cut so; packed (`thd`) every segment of `cu_seqlens`
(each padded to a multiple of 2 x CP by `batching.collate_packed`) is cut so, and a rank's tokens
are its two chunks of every segment, segment after segment (megatron's `_apply_rotary_pos_emb_thd`
layout). `columns()` gives a rank's column indices into the full row.

Attention (`attend`): each rank all-gathers the keys and values of the layer from the CP group (one
`all_gather`; its backward is a reduce-scatter of the key/value gradients, `_GatherKV`), puts them
back in sequence order, and lets each of its two query chunks attend causally to the keys before it
(a "lower-right" causal mask: chunk i sees keys [0, (i + 1) c) of its sequence). No ring: simple and
exact, at the cost of holding one layer's full-length keys and values (saved for the backward, so
per layer 2 x L x kv_heads x head_dim activations instead of 1/CP of it; docs/context-parallel.md,
"Memory").

Token outputs (`CPSlice.gather`): the model's output covers the rank's tokens only. Log-probs,
entropy and values are computed per position on the rank's slice (the [L, V/tp] logits are never
gathered) and then all-gathered into full rows (`_GatherOwn`), so every CP rank runs the unchanged
loss code on whole sequences and gets the same loss. The backward of that gather keeps the rank's own
slice of the gradient, which is exact because every CP rank computes the same loss from the same
gathered values; the rank's parameter gradients are then its tokens' share, and megatron's DDP sums
them over the data-parallel-with-CP group (the trainer scales the loss by DP x CP, which DDP
divides by).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from rlslurm.models.attention_ops import repeat_kv_heads


def _ps():
    from megatron.core import parallel_state as ps

    return ps


def cp_size() -> int:
    ps = _ps()
    if not ps.model_parallel_is_initialized():
        return 1
    return ps.get_context_parallel_world_size()


def cp_group():
    return _ps().get_context_parallel_group()


def cp_rank() -> int:
    return _ps().get_context_parallel_rank()


def _rank_cols(bounds: list[int], cp: int, r: int) -> list[int]:
    cols: list[int] = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        n = b - a
        if n % (2 * cp):
            raise ValueError(f"context parallelism: a sequence of {n} tokens is not a multiple of 2 x CP = {2 * cp}")
        c = n // (2 * cp)
        cols += range(a + r * c, a + (r + 1) * c)
        cols += range(a + (2 * cp - 1 - r) * c, a + (2 * cp - r) * c)
    return cols


@functools.lru_cache(maxsize=256)
def _layout(bounds: tuple[int, ...], cp: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(_rank_cols(list(bounds), cp, r)) for r in range(cp))


@functools.lru_cache(maxsize=256)
def _inverse(bounds: tuple[int, ...], cp: int) -> Tensor:
    """For every full column, its position in the rank-concatenated order (CPU, long)."""
    return torch.argsort(torch.tensor([c for r in _layout(bounds, cp) for c in r], dtype=torch.long))


def columns(bounds: list[int] | tuple[int, ...], cp: int, rank: int) -> list[int]:
    """The columns of a row that CP rank `rank` holds, in its local order. `bounds`: the row's
    sequence boundaries ([0, L] padded; `cu_seqlens` packed), each sequence a multiple of 2 x CP."""
    return list(_layout(tuple(int(b) for b in bounds), cp)[rank])


@dataclass(frozen=True)
class CPSlice:
    """Where this CP rank's tokens sit in the full row(s) of a micro-batch."""

    cols: Tensor        # long [Lc]: this rank's columns, in its local order
    inverse: Tensor     # long [L]: position in the rank-concatenated order of every full column
    width: int          # L
    group: Any

    def local(self, x: Tensor, dim: int = 1) -> Tensor:
        return x.index_select(dim, self.cols.to(x.device))

    def gather(self, x: Tensor, dim: int = 1) -> Tensor:
        """This rank's per-position values [.., Lc, ..] -> the full rows [.., L, ..] on every CP rank,
        differentiable (the backward keeps this rank's slice: every CP rank must compute the same
        function of the result, as the loss code does)."""
        full = _GatherOwn.apply(x.contiguous(), dim, self.group)
        return full.index_select(dim, self.inverse.to(x.device))


def slice_for(bounds: list[int] | tuple[int, ...], width: int, device: torch.device | None = None) -> CPSlice | None:
    """The CPSlice of a row with these sequence bounds at the current CP size (None at CP 1)."""
    cp = cp_size()
    if cp == 1:
        return None
    key = tuple(int(b) for b in bounds)
    if key[0] != 0 or key[-1] != width:
        raise ValueError(f"context parallelism: bounds {list(bounds)} do not cover a row of {width}")
    return CPSlice(cols=torch.tensor(_layout(key, cp)[cp_rank()], dtype=torch.long, device=device),
                   inverse=_inverse(key, cp).to(device), width=width, group=cp_group())


def mb_slice(tokens: Tensor, cu_seqlens: Tensor | None) -> CPSlice | None:
    """The CPSlice of a micro-batch: its packed segments, or each padded row whole."""
    if cp_size() == 1:
        return None
    width = int(tokens.shape[1])
    bounds = cu_seqlens.tolist() if cu_seqlens is not None else [0, width]
    return slice_for(bounds, width, tokens.device)


# ------------------------------------------------------------------------------ collectives


def _all_gather(x: Tensor, group, dim: int) -> Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def _own(x: Tensor, group, dim: int) -> Tensor:
    return x.chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)]


class _GatherOwn(torch.autograd.Function):
    """all_gather along `dim`; backward: this rank's slice of the gradient (no communication)."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _own(grad, ctx.group, ctx.dim).contiguous(), None, None


class _GatherKV(torch.autograd.Function):
    """all_gather along dim 0; backward: the gradients of every rank summed, this rank's slice kept
    (a reduce-scatter: NCCL's, or an all-reduce and a slice where the backend has none, e.g. gloo)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return _all_gather(x.contiguous(), group, 0)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        n = dist.get_world_size(ctx.group)
        if grad.is_cuda and dist.get_backend(ctx.group) == "nccl":
            out = grad.new_empty((grad.shape[0] // n, *grad.shape[1:]))
            dist.reduce_scatter_tensor(out, grad, group=ctx.group)
            return out, None
        total = grad.clone()
        dist.all_reduce(total, group=ctx.group)
        return _own(total, ctx.group, 0).contiguous(), None


# ------------------------------------------------------------------------------ attention


def _lower_right(q: Tensor, k: Tensor, v: Tensor, scale: float | None, fp32: bool) -> Tensor:
    """[b, h, sq, d] queries, each the last sq positions of the sk keys' sequence: causal attention
    aligned at the bottom right (query i sees keys [0, sk - sq + i])."""

    k, v = repeat_kv_heads(q, k, v)
    sq, sk = q.shape[-2], k.shape[-2]
    dtype = q.dtype
    if fp32 and dtype != torch.float32 and not q.is_cuda:
        q, k, v = q.float(), k.float(), v.float()
    if sq == sk:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        try:
            from torch.nn.attention.bias import causal_lower_right

            mask: Any = causal_lower_right(sq, sk)
        except ImportError:  # older torch: an explicit [sq, sk] mask
            qpos = torch.arange(sk - sq, sk, device=q.device)
            mask = torch.arange(sk, device=q.device)[None, :] <= qpos[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.to(dtype)


def _full_kv(key: Tensor, value: Tensor, bounds: list[int], group) -> tuple[Tensor, Tensor]:
    """Every CP rank's keys/values along dim 0, back in sequence order."""
    inv = _inverse(tuple(bounds), dist.get_world_size(group)).to(key.device)
    return (_GatherKV.apply(key, group).index_select(0, inv), _GatherKV.apply(value, group).index_select(0, inv))


def attend_padded(query: Tensor, key: Tensor, value: Tensor, *, scale: float | None, fp32: bool, group) -> Tensor:
    """[s, b, h, d] local (this rank's two chunks of every row) -> [s, b, h * dv]."""
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    s, b = query.shape[0], query.shape[1]
    c = s // 2
    kf, vf = _full_kv(key, value, [0, s * cp], group)
    outs = []
    for half, i in ((0, r), (1, 2 * cp - 1 - r)):
        q = query[half * c:(half + 1) * c].permute(1, 2, 0, 3)
        n = (i + 1) * c
        k, v = (t[:n].permute(1, 2, 0, 3) for t in (kf, vf))
        outs.append(_lower_right(q, k, v, scale, fp32).permute(2, 0, 1, 3))
    return torch.cat(outs, dim=0).reshape(s, b, -1)


def attend_packed(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, *, scale: float | None, fp32: bool,
                  group, varlen=None) -> Tensor:
    """[t, h, d] local (this rank's two chunks of every segment of the global `cu_seqlens`) ->
    [t, h * dv]. `varlen`: rlslurm.models.attention_ops.varlen_causal's kernel (CUDA, fp16/bf16), which
    takes every chunk against its key prefix in one call; else one SDPA call per chunk."""
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    bounds = [int(x) for x in cu_seqlens.tolist()]
    kf, vf = _full_kv(key, value, bounds, group)
    # per chunk: (first local row, length, first key, number of keys)
    chunks, at = [], 0
    for a, b in zip(bounds[:-1], bounds[1:]):
        c = (b - a) // (2 * cp)
        for i in (r, 2 * cp - 1 - r):
            chunks.append((at, c, a, (i + 1) * c))
            at += c
    if varlen is not None:
        fn, causal, gqa = varlen
        idx = torch.cat([torch.arange(k0, k0 + nk, device=key.device) for _, _, k0, nk in chunks])
        kp, vp = kf.index_select(0, idx), vf.index_select(0, idx)
        kw = dict(causal)
        if gqa and kp.shape[1] != query.shape[1]:
            kw["enable_gqa"] = True
        else:
        
            kp, vp = repeat_kv_heads(query, kp, vp)
        cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(ch[j] for ch in chunks)], dtype=torch.int32,
                                   device=query.device) for j in (1, 3))
        # flash's causal mask with fewer queries than keys is aligned at the bottom right (each
        # query chunk is the end of its key prefix); tests/gpu/test_context_parallel.py checks it
        out = fn(query, kp, vp, cu_q, cu_k, max(ch[1] for ch in chunks), max(ch[3] for ch in chunks),
                 scale=scale, **kw)
        return out.reshape(query.shape[0], -1)
    outs = []
    for q0, c, k0, nk in chunks:
        q = query[q0:q0 + c].permute(1, 0, 2).unsqueeze(0)
        k, v = (t[k0:k0 + nk].permute(1, 0, 2).unsqueeze(0) for t in (kf, vf))
        outs.append(_lower_right(q, k, v, scale, fp32)[0].permute(1, 0, 2).reshape(c, -1))
    return torch.cat(outs, dim=0)
