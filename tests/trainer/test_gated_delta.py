"""rlslurm's gated delta net kernels (rlslurm/models/gated_delta.py) against a plain per-timestep
recurrence written here, in fp32: outputs, final states and gradients, over several chunks, with an
initial state, unequal key/value widths, and a sequence that is not a multiple of the chunk."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlslurm.models import gated_delta as gd


def _loop(q, k, v, g, beta, state=None):
    """o_t = S_t^T q_t / sqrt(d_k), S_t = e^{g_t} S_{t-1} + beta_t k_t (v_t - e^{g_t} S_{t-1}^T k_t)^T,
    one batch, head and time step at a time (no vectorisation to get wrong)."""
    b, s, h, dk = k.shape
    dv = v.shape[-1]
    out = torch.zeros(b, s, h, dv, dtype=torch.float64)
    final = torch.zeros(b, h, dk, dv, dtype=torch.float64)
    for i in range(b):
        for j in range(h):
            S = torch.zeros(dk, dv, dtype=torch.float64) if state is None else state[i, j].double()
            for t in range(s):
                S = S * torch.exp(g[i, t, j].double())
                kt, vt, qt = k[i, t, j].double(), v[i, t, j].double(), q[i, t, j].double()
                S = S + torch.outer(kt, beta[i, t, j].double() * (vt - S.T @ kt))
                out[i, t, j] = S.T @ qt / dk ** 0.5
            final[i, j] = S
    return out, final


def _inputs(b=2, s=37, h=3, dk=8, dv=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    q, k = gd.l2norm(r(b, s, h, dk)), gd.l2norm(r(b, s, h, dk))
    v = r(b, s, h, dv)
    g = -F.softplus(r(b, s, h)) * 0.5     # log decay <= 0, as -exp(A_log) * softplus(a + dt_bias)
    beta = torch.sigmoid(r(b, s, h))
    state = r(b, h, dk, dv) * 0.3
    return q, k, v, g, beta, state


@pytest.mark.parametrize("chunk", [1, 8, 16, 64])
def test_chunked_rule_is_the_recurrence(chunk):
    q, k, v, g, beta, state = _inputs()
    ref, ref_state = _loop(q, k, v, g, beta, state)
    o, st = gd.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                      chunk_size=chunk)
    assert o.dtype == torch.float32 and o.shape == v.shape
    assert float((o.double() - ref).abs().max()) < 1e-5
    assert float((st.double() - ref_state).abs().max()) < 1e-5
    o2, st2 = gd.recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True)
    assert float((o2.double() - ref).abs().max()) < 1e-5 and float((st2.double() - ref_state).abs().max()) < 1e-5


def test_chunked_rule_gradients_are_the_recurrences():
    q, k, v, g, beta, _ = _inputs(b=1, s=21, h=2, dk=4, dv=6, seed=1)
    grads = []
    for fn in (gd.recurrent_gated_delta_rule,
               lambda *a, **kw: gd.chunk_gated_delta_rule(*a, chunk_size=8, **kw)):
        xs = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
        o, _ = fn(*xs, use_qk_l2norm_in_kernel=True)
        (o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum().backward()
        grads.append([x.grad for x in xs])
    for a, b in zip(*grads):
        assert float((a - b).abs().max()) < 1e-5


def test_l2norm_in_kernel_and_scale():
    q, k, v, g, beta, _ = _inputs(seed=2)
    raw_q, raw_k = q * 3.0, k * 0.5
    a, _ = gd.chunk_gated_delta_rule(raw_q, raw_k, v, g, beta, use_qk_l2norm_in_kernel=True, chunk_size=16)
    b, _ = gd.chunk_gated_delta_rule(gd.l2norm(raw_q), gd.l2norm(raw_k), v, g, beta, chunk_size=16)
    assert float((a - b).abs().max()) < 1e-6
    c, _ = gd.chunk_gated_delta_rule(q, k, v, g, beta, scale=1.0, chunk_size=16)
    d, _ = gd.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16)
    assert float((c / q.shape[-1] ** 0.5 - d).abs().max()) < 1e-6


def test_causal_conv1d_is_a_left_padded_depthwise_convolution():
    gen = torch.Generator().manual_seed(3)
    x, w, bias = torch.randn(2, 5, 9, generator=gen), torch.randn(5, 4, generator=gen), torch.randn(5, generator=gen)
    out = gd.causal_conv1d_fn(x, w, bias, activation="silu")
    ref = torch.zeros_like(x)
    for c in range(5):
        for t in range(9):
            acc = bias[c].clone()
            for j in range(4):
                src = t - 3 + j
                if src >= 0:
                    acc = acc + w[c, j] * x[:, c, src]
            ref[:, c, t] = F.silu(acc)
    assert float((out - ref).abs().max()) < 1e-6
    with pytest.raises(ValueError, match="activation"):
        gd.causal_conv1d_fn(x, w, activation="gelu")


def test_l2norm():
    x = torch.randn(4, 7, dtype=torch.float64)
    assert torch.allclose(gd.l2norm(x, eps=0.0).norm(dim=-1), torch.ones(4, dtype=torch.float64))
