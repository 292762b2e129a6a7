"""rlslurm/models/hadamard.py: the Walsh-Hadamard transform GLM-5's sparse-attention indexer rotates
its queries and keys with (megatron-core's DSA imports fast_hadamard_transform, a CUDA extension
absent here), against the dense Sylvester Hadamard matrix."""

from __future__ import annotations

import pytest
import torch

from rlslurm.models.hadamard import hadamard_transform, rotate_activation


def _sylvester(d: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@pytest.mark.parametrize("d", [1, 2, 8, 128])
def test_equals_the_dense_hadamard_matrix(d):
    """x @ H_d * scale over the last dimension, any leading shape (here megatron's [s, b, heads, d])."""
    x = torch.randn(3, 2, 4, d, dtype=torch.float64, generator=torch.Generator().manual_seed(d))
    want = (x @ _sylvester(d)) * 0.5
    got = hadamard_transform(x.float(), scale=0.5)
    assert got.shape == x.shape and got.dtype == torch.float32
    assert torch.allclose(got.double(), want, atol=1e-5 * d ** 0.5, rtol=0)


def test_rotation_is_orthonormal_keeps_dot_products_and_dtype():
    """scale d**-0.5 (megatron's rotate_activation): applied twice it is the identity, and it keeps
    every q . k, so the indexer's scores change by rounding only; bf16 in, bf16 out (fp32 sums)."""
    q, k = torch.randn(2, 5, 64, dtype=torch.float64).unbind(0)
    assert torch.allclose(rotate_activation(rotate_activation(q)), q, atol=1e-12)
    assert torch.allclose(rotate_activation(q) @ rotate_activation(k).T, q @ k.T, atol=1e-12)
    xb = torch.randn(4, 32).bfloat16()
    out = rotate_activation(xb)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, (xb.float() @ _sylvester(32).float() * 32 ** -0.5).bfloat16())


def test_gradient_is_the_transposed_transform():
    x = torch.randn(3, 16, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 16, dtype=torch.float64)
    (hadamard_transform(x, 0.25) * g).sum().backward()
    assert torch.allclose(x.grad, g @ _sylvester(16).T * 0.25)


@pytest.mark.parametrize("d", [0, 3, 96])
def test_a_width_that_is_not_a_power_of_two_is_refused(d):
    with pytest.raises(ValueError, match=f"last dimension \\({d}\\) must be a power of 2"):
        hadamard_transform(torch.zeros(2, d))


def test_megatrons_dsa_indexer_uses_it_in_rlslurms_build():
    """rlslurm's GLM-5 indexer rotates with this transform (megatron's own rotate_activation asserts
    bf16 and needs fast_hadamard_transform)."""
    from rlslurm.models import dsa

    assert dsa.rotate_activation is rotate_activation
    cls = dsa._indexer_class()
    assert "rotate_activation" in cls.forward_with_scores.__code__.co_names
