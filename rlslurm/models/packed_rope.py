"""Rotary embeddings of packed (thd) sequences without a host sync per layer.

megatron-core's unfused thd rotary (rope_utils `_apply_rotary_pos_emb_thd`, the path without
transformer-engine's fused kernel) reads the sequence lengths back to the host (`cu_seqlens.tolist()`,
and `cu_seqlens[-1].item()` in 0.19) and rotates one sequence at a time: for q and k of every layer of
every micro-batch. On a GPU each read waits for every kernel queued before it, so the host never runs
ahead: the packed step of qwen3-1.7B spent 1.2 s of kernels in 1.75 s (bench/results/gpu-lease-2026-12-07f.md,
docs/sequence-packing.md). Here each token's position within its sequence is computed on the device
(`cu_seqlens` -> positions, no read-back), the frequencies are gathered per token, and megatron's own
bshd rotary rotates the whole pack in one pass: the same elementwise operations on the same values, so
the result is bit for bit megatron's.

`install()` puts `apply_rotary_pos_emb` below in place of megatron's in the attention modules that call it
(as models/gated_delta.py does for its kernels); every case it does not handle goes to megatron's own.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

# the modules that bind megatron's apply_rotary_pos_emb at import and call it per layer
_CALLERS = ("megatron.core.transformer.attention", "megatron.core.transformer.multi_latent_attention")


def token_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Each of the `total` packed tokens' position within its own sequence, on cu_seqlens' device; no read
    back to the host (`output_size` tells repeat_interleave the length it would otherwise sync for)."""
    cu = cu_seqlens.long()
    starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1], output_size=total)
    return torch.arange(total, device=cu.device) - starts


def _context_parallel(cp_group: Any) -> bool:
    if cp_group is not None:
        return cp_group.size() > 1
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_world_size() > 1


def _wrap(megatrons: Any):
    def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, config: Any, cu_seqlens: torch.Tensor | None = None,
                             *args: Any, **kwargs: Any) -> torch.Tensor:
        """megatron's apply_rotary_pos_emb; packed ([t, h, d] with cu_seqlens, unfused, no CP, frequencies
        per position [max_s, 1, 1, d]) by position without a host read-back (module docstring)."""
        if (cu_seqlens is None or config.apply_rope_fusion or args or freqs.dim() != 4 or freqs.size(1) != 1
                # megatron reads frequencies as long as the pack as each token's own ("exact mapping")
                or freqs.size(0) == t.size(0) or _context_parallel(kwargs.get("cp_group"))):
            return megatrons(t, freqs, config, cu_seqlens, *args, **kwargs)
        per_token = freqs[token_positions(cu_seqlens, t.size(0))]  # [t, 1, 1, d]
        return megatrons(t.unsqueeze(1), per_token, config, None, **kwargs).squeeze(1)

    apply_rotary_pos_emb.megatrons = megatrons  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def install() -> None:
    """rlslurm's packed rotary in megatron's attention modules; idempotent."""
    from megatron.core.models.common.embeddings import rope_utils

    ours = None
    for name in _CALLERS:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        current = getattr(mod, "apply_rotary_pos_emb", None)
        if current is None or hasattr(current, "megatrons"):
            continue
        if current is not rope_utils.apply_rotary_pos_emb:  # someone else's: leave it
            continue
        ours = ours or _wrap(rope_utils.apply_rotary_pos_emb)
        mod.apply_rotary_pos_emb = ours
