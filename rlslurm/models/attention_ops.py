"""The local attention kernels that the trainer's core attention (models/specs.py
`SDPACoreAttention`) and its context-parallel form (models/context_parallel.py) share: grouped
query heads expanded, and torch's flash varlen attention for packed sequences."""

from __future__ import annotations

import functools
import inspect

import torch


def repeat_kv_heads(q, k, v):
    """k and v with each of their (grouped query) heads repeated to q's head count; heads are dim 1
    in both layouts used here ([b, h, s, d] and packed [t, h, d])."""
    if k.shape[1] == q.shape[1]:
        return k, v
    n = q.shape[1] // k.shape[1]
    return k.repeat_interleave(n, dim=1), v.repeat_interleave(n, dim=1)


@functools.lru_cache(maxsize=1)
def varlen_attn():
    """torch's flash varlen attention (torch.nn.attention.varlen, CUDA only) and how it is told
    "causal": `window_size=(-1, 0)` in newer torch, `is_causal=True` in older; None if absent."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        return varlen_attn, {"window_size": (-1, 0)}, "enable_gqa" in params
    if "is_causal" in params:
        return varlen_attn, {"is_causal": True}, "enable_gqa" in params
    return None


def varlen_causal(query, key, value, psp, scale):
    """Packed causal attention in one kernel call per layer (the per-sequence loop is CPU-bound:
    thousands of small launches per step, docs/sequence-packing.md). [t, h, d] -> [t, h * dv]."""
    fn, causal, gqa = varlen_attn()
    kw = dict(causal)
    if gqa and key.shape[1] != query.shape[1]:
        kw["enable_gqa"] = True
    else:
        key, value = repeat_kv_heads(query, key, value)
    cu = psp.cu_seqlens_q.to(torch.int32)
    out = fn(query, key, value, cu, cu, psp.max_seqlen_q, psp.max_seqlen_kv, scale=scale, **kw)
    return out.reshape(query.shape[0], -1)
