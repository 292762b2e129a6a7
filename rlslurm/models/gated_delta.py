"""Gated delta net kernels in plain torch, for megatron-core's `GatedDeltaNet` (Qwen3-Next, Qwen3.5).

megatron-core 0.16's `ssm/gated_delta_net.py` takes its kernels from two CUDA packages, `fla`
(`l2norm`, `chunk_gated_delta_rule`) and `causal_conv1d` (`causal_conv1d_fn`), and refuses to build
the layer without `fla` (`GatedDeltaNet.__init__`: "FLA is not installed"); 0.19 makes it a package of
the same path and takes the convolution from fla too (`causal_conv1d`, another interface:
docs/megatron-versions.md, "Gated delta net"). Neither package is installed here, on the CPU or on the
GPU machines. This module holds rlslurm's own torch versions of the kernels, with the signatures megatron
calls them by, correct in fp32 on any device, and `install()` puts them into megatron's module namespaces
where `fla` is missing (docs/model-families.md, "Qwen3-Next").

Why install rather than a layer of our own: megatron's `GatedDeltaNet` already is the layer the
model needs (its in_proj/conv1d/A_log/dt_bias/out_norm/out_proj, the TP split of each, and the
`sharded_state_dict` that re-shards its fused in_proj between TP sizes); only its kernels are
missing. Its forward calls them through module globals, so setting those globals is the whole
change, and where `fla` is installed megatron keeps it.

The recurrence (per head, state S of shape [d_k, d_v], decay g_t <= 0 in log space, 0 < beta_t < 1):

    S_t = exp(g_t) S_{t-1}
    S_t = S_t + k_t (beta_t (v_t - S_t^T k_t))^T        (the delta rule: write what S misreads)
    o_t = scale * S_t^T q_t                              (scale = d_k ** -0.5 unless given)

`recurrent_gated_delta_rule` runs it step by step (the reference). `chunk_gated_delta_rule` gives the
same numbers a chunk of C steps at a time: within a chunk, with G_t the cumulative log decay since
the chunk start and S0 the state before it, the corrections u_t = beta_t (v_t - S_{t-1}'^T k_t)
solve one unit lower-triangular system

    (I + A) U = diag(beta) V - diag(beta exp(G)) K S0,   A[t, i] = beta_t exp(G_t - G_i) k_t.k_i  (i < t)

so U = W - Y S0 with W, Y from one triangular solve per chunk (independent of S0), and then

    O   = scale ((exp(G) q) S0 + (M * (Q K^T)) U),        M[t, i] = exp(G_t - G_i) for i <= t
    S_C = exp(G_C) S0 + (exp(G_C - G) k)^T U

Only the state passes from chunk to chunk. Everything runs in fp32 and returns the input dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) along `dim` (fla's l2norm, which megatron calls with its default eps;
    transformers' Qwen3-Next computes the same with eps 1e-6)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def causal_conv1d_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     activation: str | None = None, **_: Any) -> torch.Tensor:
    """Depthwise causal convolution: x [batch, channels, seq], weight [channels, kernel] -> [batch,
    channels, seq], out[:, c, t] = bias[c] + sum_j weight[c, j] x[:, c, t - (kernel - 1) + j] (zeros
    before the start), then SiLU when `activation` is "silu"/"swish" (causal_conv1d's signature)."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"causal_conv1d_fn: activation {activation!r} (silu, swish or None)")
    channels, kernel = weight.shape
    out = F.conv1d(F.pad(x.to(weight.dtype), (kernel - 1, 0)), weight.unsqueeze(1), bias, groups=channels)
    if activation is not None:
        out = F.silu(out)
    return out.to(x.dtype)


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel):
    """[b, s, h, d] / [b, s, h] inputs -> fp32 [b, h, s, d] / [b, h, s], q scaled."""
    if q.shape[2] != v.shape[2] or k.shape[2] != v.shape[2]:
        raise ValueError(f"gated delta rule: q/k heads {q.shape[2]}/{k.shape[2]} and v heads {v.shape[2]} "
                         "must be equal (repeat q/k first)")
    q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))
    g, beta = (t.transpose(1, 2).float() for t in (g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return q * scale, k, v, g, beta


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, scale: float | None = None,
                               initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                               use_qk_l2norm_in_kernel: bool = False, **_: Any):
    """The gated delta rule one step at a time (the reference the chunked form is tested against).
    q, k [b, s, h, d_k]; v [b, s, h, d_v]; g (log decay), beta [b, s, h]; state [b, h, d_k, d_v].
    Returns (o [b, s, h, d_v] in v's dtype, final state in fp32 or None)."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    b, h, s, dk = k.shape
    state = (q.new_zeros(b, h, dk, v.shape[-1]) if initial_state is None else initial_state.float())
    out = []
    for t in range(s):
        state = state * g[:, :, t, None, None].exp()
        read = torch.einsum("bhkv,bhk->bhv", state, k[:, :, t])
        state = state + k[:, :, t, :, None] * (beta[:, :, t, None] * (v[:, :, t] - read))[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, :, t]))
    o = torch.stack(out, dim=2) if out else v.new_zeros(v.shape)
    return o.transpose(1, 2).contiguous().to(dtype), (state if output_final_state else None)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           scale: float | None = None, initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                           chunk_size: int = 64, **_: Any):
    """The gated delta rule `chunk_size` steps at a time (module docstring); same arguments and results
    as `recurrent_gated_delta_rule` (and fla's `chunk_gated_delta_rule`, which megatron calls)."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    b, h, s, dk = k.shape
    dv = v.shape[-1]
    c = chunk_size
    pad = (-s) % c
    if pad:
        # padded steps: no decay (g 0) and no write (beta 0, k 0), outputs dropped below
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (s + pad) // c
    q, k, v = (t.reshape(b, h, n, c, -1) for t in (q, k, v))
    g, beta = (t.reshape(b, h, n, c) for t in (g, beta))

    G = g.cumsum(-1)                                           # [b, h, n, c]
    diff = G[..., :, None] - G[..., None, :]                   # G_t - G_i
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = diff.masked_fill(~causal, float("-inf")).exp()    # M: exp(G_t - G_i) for i <= t, else 0
    strict = torch.ones(c, c, dtype=torch.bool, device=q.device).tril(-1)
    a = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).masked_fill(~strict, 0.0)
    eye = torch.eye(c, dtype=q.dtype, device=q.device)
    rhs = torch.cat([beta[..., None] * v, (beta * G.exp())[..., None] * k], dim=-1)
    wy = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
    w, y = wy[..., :dv], wy[..., dv:]                          # U = W - Y S0
    qk = (q @ k.transpose(-1, -2)) * decay                     # M * (Q K^T)
    q_in = q * G.exp()[..., None]                              # reads S0 through the decay so far
    k_out = k * (G[..., -1:] - G).exp()[..., None]             # writes decayed to the chunk end
    end = G[..., -1].exp()                                     # [b, h, n]

    state = q.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.float()
    out = []
    for i in range(n):
        u = w[:, :, i] - y[:, :, i] @ state
        out.append(q_in[:, :, i] @ state + qk[:, :, i] @ u)
        state = state * end[:, :, i, None, None] + k_out[:, :, i].transpose(-1, -2) @ u
    o = torch.stack(out, dim=2).reshape(b, h, n * c, dv)[:, :, :s]
    return o.transpose(1, 2).contiguous().to(dtype), (state if output_final_state else None)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  activation: str | None = None, initial_state: torch.Tensor | None = None,
                  output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None, **_: Any):
    """fla's `causal_conv1d`, which megatron-core 0.19 calls instead of causal_conv1d's `causal_conv1d_fn`:
    x [batch, seq, channels] -> (the same convolution as causal_conv1d_fn, [batch, seq, channels], None).
    No initial state and no packed sequences (rlslurm refuses those for gated delta nets)."""
    if initial_state is not None or output_final_state or cu_seqlens is not None:
        raise NotImplementedError("causal_conv1d: initial_state, output_final_state and cu_seqlens are not supported")
    return causal_conv1d_fn(x.transpose(1, 2), weight, bias, activation).transpose(1, 2), None


# Where megatron-core keeps the kernels its GatedDeltaNet calls, and what rlslurm puts there
# (docs/megatron-versions.md, "Gated delta net"): 0.16 has one module, `ssm/gated_delta_net.py`
# (causal_conv1d's `causal_conv1d_fn`); 0.19 a package whose `common` checks HAVE_FLA and calls
# l2norm, and whose `gdn` imported fla's `causal_conv1d` and `chunk_gated_delta_rule` by name.
_MODULES = ("megatron.core.ssm.gated_delta_net", "megatron.core.ssm.gated_delta_net.common",
            "megatron.core.ssm.gated_delta_net.gdn")
_KERNELS = {"l2norm": l2norm, "chunk_gated_delta_rule": chunk_gated_delta_rule,
            "causal_conv1d_fn": causal_conv1d_fn, "causal_conv1d": causal_conv1d}


def install() -> bool:
    """Give megatron-core's gated delta net modules these kernels where `fla` / `causal_conv1d` are
    missing (its GatedDeltaNet refuses to build without fla and calls the kernels through module
    globals). Idempotent. Returns True when rlslurm's kernels are in use, False when fla's are."""
    import importlib

    from megatron.core.ssm import gated_delta_net as gdn

    if getattr(gdn, "HAVE_FLA", False) and getattr(gdn.chunk_gated_delta_rule, "__module__", "") != __name__:
        return False
    for name in _MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:  # 0.16: no package, one module
            continue
        for attr, kernel in _KERNELS.items():
            # the conv kernels only where the module imported none (0.16 binds no l2norm without fla)
            if attr in ("l2norm", "chunk_gated_delta_rule") or getattr(mod, attr, kernel) in (None, kernel):
                setattr(mod, attr, kernel)
        if hasattr(mod, "HAVE_FLA"):
            mod.HAVE_FLA = True
    return True


def context_parallel_gated_delta_net():
    """megatron-core's GatedDeltaNet with context parallelism (CP > 1), as rlslurm lays tokens out for it
    (models/context_parallel.py: CP rank r holds chunks r and 2 CP - 1 - r of each sequence).

    megatron-core 0.16's GatedDeltaNet has no CP (its TransformerConfig asserts context_parallel_size 1).
    The recurrence runs over the whole sequence, so this subclass does what rlslurm's CP attention does
    with keys and values: each rank projects its own tokens (in_proj), all-gathers the projections of
    the CP group and puts them back in sequence order, runs the convolution, the gated delta rule and the
    gated norm over the whole sequence, keeps its own tokens' outputs and projects them (out_proj). The
    gather's backward sums every rank's gradient for a position and keeps the rank's own (a
    reduce-scatter, context_parallel._GatherKV), so the in_proj gradients are exact, and each rank's
    conv/A_log/dt_bias/norm gradients are its own tokens' share, which megatron's DDP sums over the
    data-parallel-with-CP group as it does for attention. Exact, not faster: every CP rank computes the
    mixing of the whole sequence (3 of 4 layers in Qwen3-Next), and holds it for the backward
    (docs/model-families.md, "Qwen3-Next"). At CP 1 it is megatron's forward, unchanged."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    class ContextParallelGatedDeltaNet(GatedDeltaNet):
        def forward(self, hidden_states, attention_mask=None, **kwargs):
            # by keyword, as TransformerLayer calls it: megatron-core 0.19 dropped the positional
            # key_value_states and attention_bias of 0.16's signature
            if self.config.context_parallel_size == 1:
                return super().forward(hidden_states, attention_mask, **kwargs)
            if any(kwargs.get(k) is not None for k in ("packed_seq_params", "inference_context", "inference_params")):
                raise NotImplementedError("gated delta net with context parallelism: padded training input only")
            from rlslurm.models import context_parallel as cpx

            group = cpx.cp_group()
            cp = torch.distributed.get_world_size(group)
            qkvzba, _ = self.in_proj(hidden_states)              # [s_local, b, in_proj_dim / tp]
            s_local = qkvzba.shape[0]
            inverse = cpx._inverse((0, s_local * cp), cp).to(qkvzba.device)
            full = cpx._GatherKV.apply(qkvzba, group).index_select(0, inverse)   # [s, b, .] in sequence order
            mixed = self._mix(full)                              # [s, b, v_dim / tp]
            cols = torch.tensor(cpx.columns([0, s_local * cp], cp, cpx.cp_rank()), device=mixed.device)
            return self.out_proj(mixed.index_select(0, cols).contiguous())

        def _mix(self, qkvzba: torch.Tensor) -> torch.Tensor:
            """The part of GatedDeltaNet.forward between in_proj and out_proj, over the whole sequence:
            [s, b, in_proj_dim / tp] -> [s, b, v_dim / tp] (the same steps as megatron's, in order)."""
            tp = self.tp_size
            seq, batch = qkvzba.shape[0], qkvzba.shape[1]
            x = qkvzba.transpose(0, 1)
            qkv, gate, beta, alpha = torch.split(
                x, [(2 * self.qk_dim + self.v_dim) // tp, self.v_dim // tp, self.num_value_heads // tp,
                    self.num_value_heads // tp], dim=-1)
            w = self.conv1d.weight.squeeze(1)
            qkv = causal_conv1d_fn(qkv.transpose(1, 2).contiguous(), w, self.conv1d.bias, "silu").transpose(1, 2)
            q, k, v = torch.split(qkv, [self.qk_dim // tp, self.qk_dim // tp, self.v_dim // tp], dim=-1)
            q = l2norm(q.reshape(batch, seq, -1, self.key_head_dim))
            k = l2norm(k.reshape(batch, seq, -1, self.key_head_dim))
            v = v.reshape(batch, seq, -1, self.value_head_dim)
            rep = self.num_value_heads // self.num_key_heads
            if rep > 1:
                q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
            g = -self.A_log.exp() * F.softplus(alpha.float() + self.dt_bias)
            out, _ = chunk_gated_delta_rule(q, k, v, g, beta.sigmoid())
            norm = self._apply_gated_norm(out, gate.reshape(batch, seq, -1, self.value_head_dim))
            return norm.reshape(batch, seq, -1).transpose(0, 1).contiguous()

    return ContextParallelGatedDeltaNet


class GatedOutputNorm(torch.nn.Module):
    """The gated delta net's output norm (transformers' Qwen3NextRMSNormGated before its gate, which
    megatron's GatedDeltaNet applies itself): RMS-normalise each value head in fp32, cast back, times
    the weight. A plain weight, initialised to ones, NOT offset from 1 as the model's other norms
    are (`layernorm_zero_centered_gamma`), so it is its own module rather than the config's norm.

    Its input is this TP rank's value heads only, so its weight's gradient is partial on each rank:
    marked `sequence_parallel`, which megatron's finalize_model_grads sums over TP (the trainer turns
    sequence parallelism on for gated-delta models at TP > 1, models/build.py)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_: Any):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        if config.sequence_parallel:
            setattr(self.weight, "sequence_parallel", True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm whose weight is stored as its offset from 1 (megatron's `layernorm_zero_centered_gamma`,
    transformers' Qwen3NextRMSNorm): fp32 x * rsqrt(mean(x^2) + eps) * (1 + weight), cast back.
    megatron's local norm (WrappedTorchNorm) refuses that setting, hence this module for the
    local spec (models/specs.py TorchNorm); the weight starts at 0."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)
