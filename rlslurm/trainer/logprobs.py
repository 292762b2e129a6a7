"""Forward a micro-batch -> per-token log-probs (and entropy, values) of the *response* tokens.

Logits are vocabulary shards under TP ([n, L, V/tp], `parallel_output=True`). Log-probs go
through megatron's `vocab_parallel_cross_entropy` (the same kernel a plain Megatron loss uses),
entropy through max/sum all-reduces over the TP group, so both equal the single-GPU values.
The padded vocabulary rows (Megatron pads V to a multiple of 128 x TP) get a huge negative logit:
HF has no such tokens, so they must not take probability mass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from rlslurm.trainer.batching import MicroBatch

if TYPE_CHECKING:
    from rlslurm.models.context_parallel import CPSlice

_NEG = -1.0e9  # exp() underflows to exactly 0 in fp32/bf16 while 0 * _NEG stays 0 (no NaN in entropy)


def forward_logits(model: torch.nn.Module, mb: MicroBatch) -> Tensor:
    """[n, L, V/tp] logits (or [n, L, 1] values for the critic). With pipeline parallelism this is
    the last stage's output; earlier stages return their hidden states [L, n, h] (a non-first
    stage ignores the tokens and reads the activation megatron's schedule set as its input).
    With context parallelism the model sees this CP rank's columns only and L is their number
    (`cp_slice(mb)`; the token functions below take that slice and return full rows)."""
    tokens, pos, packed = model_inputs(mb)
    cp = cp_slice(mb)
    if cp is not None:
        # packed, at CP > 1 megatron's thd rotary path and our attention cut the global cu_seqlens themselves
        tokens, pos = cp.local(tokens), cp.local(pos)
    return model(tokens, pos, None, **packed)


def model_inputs(mb: MicroBatch) -> tuple[Tensor, Tensor, dict[str, Any]]:
    """(tokens, positions, the packed-sequence keyword) of the whole micro-batch for megatron's model:
    padded, positions from 0 in every row; packed (thd), restarting in every segment."""
    tokens = mb.tokens
    cu = getattr(mb, "cu_seqlens", None)
    if cu is not None:
        return tokens, packed_positions(cu, tokens), {"packed_seq_params": packed_seq_params(cu)}
    return tokens, torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens), {}


def cp_slice(mb) -> "CPSlice | None":
    """This context-parallel rank's columns of the micro-batch's rows (None at CP 1)."""
    from rlslurm.models.context_parallel import mb_slice

    return mb_slice(mb.tokens, getattr(mb, "cu_seqlens", None))


def packed_seq_params(cu_seqlens: Tensor):
    """megatron's description of a packed row (qkv_format thd): self-attention, so q and kv share
    the boundaries. Rotary embeddings restart at each boundary (megatron's thd rope path)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def packed_positions(cu_seqlens: Tensor, tokens: Tensor) -> Tensor:
    """Positions restarting at 0 in every segment, [1, T] (read only by learned position embeddings;
    the rotary path takes its positions from `cu_seqlens`: models/packed_rope.py)."""
    from rlslurm.models.packed_rope import token_positions

    return token_positions(cu_seqlens, tokens.shape[1]).to(tokens.device).unsqueeze(0)


def _vocab_range() -> tuple[int, int, object]:
    from megatron.core import parallel_state as ps

    rank = ps.get_tensor_model_parallel_rank() if ps.model_parallel_is_initialized() else 0
    group = ps.get_tensor_model_parallel_group() if ps.model_parallel_is_initialized() else None
    return rank, ps.get_tensor_model_parallel_world_size() if group is not None else 1, group


def prepare_logits(logits: Tensor, vocab_size: int, temperature: float = 1.0) -> Tensor:
    """fp32 logits [n, L, V/tp] with the temperature applied and the padded vocabulary masked.

    No copy when there is nothing to do: megatron's cross entropy then subtracts the max from
    this tensor in place, which is safe because nothing else reads the logits afterwards and
    autograd saved none of them (the same as megatron's own loss path).
    """
    tp_rank, _, _ = _vocab_range()
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    local = x.shape[-1]
    start = tp_rank * local
    if start + local > vocab_size:
        ids = torch.arange(start, start + local, device=x.device)
        x = x.masked_fill(ids >= vocab_size, _NEG)
    return x


def token_logprobs(logits: Tensor, tokens: Tensor, cp: "CPSlice | None" = None) -> Tensor:
    """log p(tokens[:, t+1] | <= t) for prepared logits [n, L, V/tp] -> [n, L-1].

    The cross entropy runs over all L positions (the last one against a dummy target) so that
    the logits stay contiguous and are not copied; the last column is dropped after. With context
    parallelism (`cp`, forward_logits) the logits are this rank's columns of the full `tokens`:
    their targets are picked from the full rows and the result is gathered to full rows.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    target = torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], dim=1)
    if cp is None:
        return -vocab_parallel_cross_entropy(logits, target)[:, :-1]
    return cp.gather(-vocab_parallel_cross_entropy(logits, cp.local(target)))[:, :-1]


ENTROPY_CHUNK_ELEMS = 1 << 26  # 256 MiB of fp32 per temporary of the entropy metric


def vocab_parallel_entropy(logits: Tensor, cp: "CPSlice | None" = None, *,
                           chunk_elems: int = ENTROPY_CHUNK_ELEMS) -> Tensor:
    """Entropy of softmax over the full (TP-sharded) vocabulary: [n, L, V/tp] -> [n, L-1]
    (with context parallelism `cp`: this rank's columns in, full rows out, as token_logprobs).

    H = log Z - sum_i p_i z_i with z shifted by the global max. The all-reduces are megatron's
    autograd-aware ones, so the entropy bonus gets correct gradients under TP. As a metric (no
    gradient: the default entropy coefficient 0) it runs over a few positions at a time, each
    temporary at most `chunk_elems`: whole, its three vocabulary-sized fp32 temporaries were what
    the RL step needed beyond plain megatron's, and qwen3-4B on one H100 died there at two samples
    per micro-batch (bench/results/gpu-lease-2026-12-07e.md).
    """
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    _, tp, group = _vocab_range()
    z = logits.float()
    m = z.detach().max(dim=-1, keepdim=True).values
    if tp > 1:
        torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=group)
    if torch.is_grad_enabled() and z.requires_grad:
        z = z - m
        e = z.exp()
        sum_exp = e.sum(dim=-1)
        sum_ez = (e * z).sum(dim=-1)
    else:
        sum_exp, sum_ez = _entropy_sums(z, m, chunk_elems)
    if tp > 1:
        sum_exp = reduce_from_tensor_model_parallel_region(sum_exp)
        sum_ez = reduce_from_tensor_model_parallel_region(sum_ez)
    h = sum_exp.log() - sum_ez / sum_exp
    return (h if cp is None else cp.gather(h))[:, :-1]


def _entropy_sums(z: Tensor, m: Tensor, chunk_elems: int) -> tuple[Tensor, Tensor]:
    """(sum_i e^(z_i - m), sum_i e^(z_i - m) (z_i - m)) over the last dimension, a slice of positions at a
    time; `z` is left as it is (the cross entropy reads it after)."""
    n, length, v = z.shape
    step = max(1, chunk_elems // max(1, n * v))
    sum_exp = z.new_empty(n, length)
    sum_ez = z.new_empty(n, length)
    for a in range(0, length, step):
        zc = z[:, a:a + step] - m[:, a:a + step]
        e = zc.exp()
        sum_exp[:, a:a + step] = e.sum(dim=-1)
        sum_ez[:, a:a + step] = e.mul_(zc).sum(dim=-1)
    return sum_exp, sum_ez


def response_slices(per_position: Tensor, mb: MicroBatch) -> list[Tensor]:
    """Per-sample 1-D tensors over the response tokens, from a [n, L-1] per-position tensor.

    Position t of the shifted tensor predicts token t+1, so response token j of a sample with
    prompt length P starting at column S of its row is at position S + P - 1 + j (packed samples
    share row 0; the position predicting the next sample's first token belongs to no response).
    """
    out = []
    for k, (p, r) in enumerate(zip(mb.prompt_lens, mb.response_lens)):
        row, start = mb.where(k)
        out.append(per_position[row, start + p - 1: start + p - 1 + r])
    return out


def values_of(values: Tensor, mb: MicroBatch) -> list[Tensor]:
    """Critic output [n, L, 1] -> per-sample values of the states before each response token
    (with context parallelism this rank's columns, gathered to full rows first)."""
    cp = cp_slice(mb)
    v = values[:, :, 0].float()
    return response_slices((v if cp is None else cp.gather(v))[:, :-1], mb)
