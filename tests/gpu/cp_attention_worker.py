"""Run by tests/gpu/test_context_parallel.py under torchrun (2 ranks, one GPU each, NCCL): rlslurm's
context-parallel core attention (models/context_parallel.py) against whole-sequence causal attention
in fp32 on one GPU — outputs and the q, k, v gradients of this rank's tokens — padded (SDPA with a
lower-right causal mask) and packed (bf16: torch's flash varlen kernel with bottom-right aligned
causal masks; fp32: one SDPA call per chunk). Prints one JSON line per rank: worst relative errors.
CP_WORKER_DEVICE=cpu: a dry run of this script on gloo (fp32 only; no varlen kernel there)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

DEV = os.environ.get("CP_WORKER_DEVICE", "cuda")


def reference(q, k, v, bounds):
    """Causal attention per sequence, fp32, [t, h, d] (grouped kv heads repeated) -> [t, h * d]."""
    h, g = q.shape[1], k.shape[1]
    parts = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        qs = q[a:b].permute(1, 0, 2)[None]
        ks, vs = (x[a:b].permute(1, 0, 2)[None].repeat_interleave(h // g, dim=1) for x in (k, v))
        parts.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)[0].permute(1, 0, 2).reshape(b - a, -1))
    return torch.cat(parts)


def check(packed: bool, dtype: torch.dtype, lens: list[int]) -> float:
    from megatron.core import parallel_state as ps

    from rlslurm.models import context_parallel as cpx
    from rlslurm.models.specs import SDPACoreAttention
    from rlslurm.trainer.logprobs import packed_seq_params

    cp = ps.get_context_parallel_world_size()
    bounds = [0, *torch.tensor(lens).cumsum(0).tolist()]
    t, h, g, d = bounds[-1], 16, 4, 128
    gen = torch.Generator(device=DEV).manual_seed(1)
    full = [torch.randn(t, n, d, device=DEV, generator=gen) for n in (h, g, g)]
    grad_full = torch.randn(t, h * d, device=DEV, generator=gen)
    cols = torch.tensor(cpx.columns(bounds, cp, ps.get_context_parallel_rank()), device=DEV)
    q, k, v = (x.index_select(0, cols).to(dtype).requires_grad_() for x in full)
    attn = SDPACoreAttention(SimpleNamespace(attention_softmax_in_fp32=True, context_parallel_size=cp), 1, None, "self")
    if packed:
        out = attn(q, k, v, packed_seq_params=packed_seq_params(torch.tensor(bounds, dtype=torch.int32, device=DEV)))
    else:  # one padded row: [s, b=1, h, d]
        out = attn(q[:, None], k[:, None], v[:, None])[:, 0]
    out.backward(grad_full.index_select(0, cols).to(dtype))
    qf, kf, vf = (x.clone().requires_grad_() for x in full)
    ref = reference(qf, kf, vf, bounds)
    ref.backward(grad_full)
    worst = 0.0
    for x, y in ((out, ref), (q.grad, qf.grad), (k.grad, kf.grad), (v.grad, vf.grad)):
        y = y.index_select(0, cols)
        worst = max(worst, float((x.float() - y).abs().max() / y.abs().max()))
    return worst


def main() -> None:
    if DEV == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if DEV == "cuda" else "gloo")
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(context_parallel_size=dist.get_world_size())
    cp = dist.get_world_size()
    # packed: each a multiple of 2 x CP
    lens = [c * 2 * cp for c in ((350, 17, 1, 1024, 64, 3) if DEV == "cuda" else (35, 7, 1, 3))]
    res = {"rank": dist.get_rank(), "cp": cp,
           "padded_fp32": check(False, torch.float32, [4096 if DEV == "cuda" else 256]),
           "packed_fp32": check(True, torch.float32, lens)}
    if DEV == "cuda":
        res.update(padded_bf16=check(False, torch.bfloat16, [4096]),
                   packed_bf16_varlen=check(True, torch.bfloat16, lens))
    print(json.dumps(res), flush=True)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
