"""Pure-torch `rotary_embedding`, the one vllm kernel SGLang 0.5.23 calls on the CPU path.

Same contract as vllm's op: rotates `query` and `key` IN PLACE.
- positions: [num_tokens] int
- query/key: [num_tokens, num_heads * head_size] (or [num_tokens, num_heads, head_size])
- cos_sin_cache: [max_position, rot_dim] = cat(cos, sin) halves, rot_dim <= head_size
- is_neox: NeoX layout (rotate the two halves) vs GPT-J layout (rotate interleaved pairs)
"""

from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    # x: [T, H, rot_dim]; cos/sin: [T, 1, rot_dim // 2]
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
                     head_size: int, cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    positions = positions.flatten()
    num_tokens = positions.shape[0]
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
    rot_dim = cos_sin_cache.shape[-1]
    for t in (query, key):
        if t is None:
            continue
        view = t.view(num_tokens, -1, head_size)
        rot = view[..., :rot_dim]
        rotated = _rotate(rot.float(), cos.unsqueeze(1).float(), sin.unsqueeze(1).float(), is_neox)
        rot.copy_(rotated.to(t.dtype))
