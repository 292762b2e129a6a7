"""Packed core attention on CUDA (`--qkv-format thd`): rlslurm's one-call varlen path equals causal
attention computed sequence by sequence in fp32 — outputs and the gradients of q, k and v — with
grouped query heads, on sequence lengths of a long-tail batch (docs/sequence-packing.md)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F


def test_varlen_packed_attention_equals_per_sequence_fp32() -> None:
    from rlslurm.models.attention_ops import varlen_attn
    from rlslurm.models.specs import SDPACoreAttention
    from rlslurm.trainer.logprobs import packed_seq_params

    if varlen_attn() is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    torch.manual_seed(0)
    lens = [700, 33, 1, 2048, 129, 5, 512]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    t, h, g, d = sum(lens), 16, 8, 128
    q, k, v = (torch.randn(t, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for n in (h, g, g))
    attn = SDPACoreAttention(SimpleNamespace(attention_softmax_in_fp32=True, context_parallel_size=1), 1, None, "self")
    out = attn(q, k, v, packed_seq_params=packed_seq_params(cu))
    grad = torch.randn_like(out)
    out.backward(grad)
    got = [out.float(), q.grad.float(), k.grad.float(), v.grad.float()]

    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    parts = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs = qf[a:b].permute(1, 0, 2)[None]
        ks, vs = (x[a:b].permute(1, 0, 2)[None].repeat_interleave(h // g, dim=1) for x in (kf, vf))
        parts.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)[0].permute(1, 0, 2).reshape(b - a, -1))
    ref = torch.cat(parts)
    ref.backward(grad.float())
    want = [ref, qf.grad, kf.grad, vf.grad]
    for name, x, y in zip(("out", "dq", "dk", "dv"), got, want):
        err = float((x - y).abs().max() / y.abs().max())
        assert err < 2e-2, (name, err)  # bf16 inputs against fp32; a wrong mask is O(1)
