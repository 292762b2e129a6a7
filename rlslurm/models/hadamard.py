"""A Walsh-Hadamard transform in plain torch, for the sparse-attention indexer (models/dsa.py).

megatron-core 0.16's DSA indexer (`transformer/experimental_attention_variant/dsa.py`
`rotate_activation`) rotates its queries and keys with `fast_hadamard_transform.hadamard_transform(x,
scale=d**-0.5)`, a CUDA extension that is installed neither here nor on the GPU machines. What it
computes is `x @ H.T * scale` over the last dimension, H the d x d Sylvester Hadamard matrix in natural
order (H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]]; symmetric). This is that product as log2(d)
butterfly stages: O(d log d), differentiable, no d x d matrix. The sums run in fp32 (fp64 for fp64
input) and the result is cast back to the input dtype, as the CUDA kernel accumulates in fp32.

With scale d**-0.5 the transform is orthonormal, so it changes no dot product q . k of two rotated
vectors (up to rounding); the reference indexer rotates before quantising to FP8, where spreading
outliers over all dimensions matters.
"""

from __future__ import annotations

import torch


def hadamard_transform(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """`x @ H_d * scale` along the last dimension `d` (a power of 2), in x's dtype."""
    d = x.shape[-1]
    if d < 1 or d & (d - 1):
        raise ValueError(f"hadamard_transform: the last dimension ({d}) must be a power of 2")
    y = x.to(torch.promote_types(x.dtype, torch.float32)).reshape(-1, d)  # fp32 sums (fp64 stays)
    half = 1
    while half < d:
        # pairs (i, i + half) inside each block of 2 * half: (a, b) -> (a + b, a - b)
        pairs = y.view(-1, d // (2 * half), 2, half)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).view(-1, d)
        half *= 2
    return (y * scale).view(x.shape).to(x.dtype)


def rotate_activation(x: torch.Tensor) -> torch.Tensor:
    """megatron-core's `dsa.rotate_activation` in any dtype: the orthonormal Hadamard rotation."""
    return hadamard_transform(x, scale=x.shape[-1] ** -0.5)
