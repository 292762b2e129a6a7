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


def test_padded_attention_on_real_tokens_equals_each_sample_alone_in_fp32() -> None:
    """The default core attention without transformer-engine (models/specs.py `core_attention`) on a
    right-padded [s, b] batch, as the trainer passes it (no padding mask, causal): on every real token the
    output and the gradients of q, k and v equal causal attention over that sample alone in fp32 (a pad
    never precedes a real token, so none is attended to)."""
    from rlslurm.models.specs import SDPACoreAttention

    torch.manual_seed(0)
    lens, s, h, g, d = [2048, 700, 33, 1], 2048, 16, 8, 128
    b = len(lens)
    q, k, v = (torch.randn(s, b, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for n in (h, g, g))
    attn = SDPACoreAttention(SimpleNamespace(attention_softmax_in_fp32=True, context_parallel_size=1), 1, None, "self")
    out = attn(q, k, v)  # [s, b, h * d]
    real = torch.zeros(s, b, 1, device="cuda")
    for i, n in enumerate(lens):
        real[:n, i] = 1.0
    grad = torch.randn_like(out) * real  # the loss reads real tokens only
    out.backward(grad)

    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    refs = []
    for i, n in enumerate(lens):
        qs = qf[:n, i].permute(1, 0, 2)[None]
        ks, vs = (x[:n, i].permute(1, 0, 2)[None].repeat_interleave(h // g, dim=1) for x in (kf, vf))
        refs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)[0].permute(1, 0, 2).reshape(n, -1))
    sum((r * grad[:n, i].float()).sum() for r, (i, n) in zip(refs, enumerate(lens))).backward()
    for i, n in enumerate(lens):
        pairs = (("out", out[:n, i], refs[i]), ("dq", q.grad[:n, i], qf.grad[:n, i]),
                 ("dk", k.grad[:n, i], kf.grad[:n, i]), ("dv", v.grad[:n, i], vf.grad[:n, i]))
        for name, x, y in pairs:
            # a one-token sample's dq is 0 (a softmax over one key): its error is absolute
            err = float((x.float() - y).abs().max() / y.abs().max().clamp_min(1.0))
            assert err < 2e-2, (name, i, err)  # bf16 inputs against fp32; a pad attended to is O(1)
