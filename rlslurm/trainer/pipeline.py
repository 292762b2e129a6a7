"""Pipeline parallelism in the RL loop: micro-batches through the stages, the last stage's results
to every stage, and every stage's exported weights to one writer.

`run_microbatches` is the only place a model is run on micro-batches. With PP = 1 it is a plain
loop (forward, loss, backward per micro-batch). With PP > 1 it hands megatron's 1F1B schedule
(`get_forward_backward_func`) a `forward_step_func` that closes over our micro-batches, in the same
order on every stage: the first stage embeds the tokens, the others take the activation received
from the previous stage, and the last stage turns the output into the caller's loss. Micro-batches
are right-padded to their own longest sample, so the stages exchange each activation's shape
first (`variable_seq_lengths`, set by `model.transformer_config` when PP > 1). megatron's p2p
defaults are kept on gloo and NCCL alike: batched isend/irecv (`batch_isend_irecv` supports
gloo; the unbatched path works too) and no p2p overlap (the 1F1B schedule refuses it).

Loss semantics are those of losses.py: each micro-batch's loss is its share of the global-batch
mean and gradients are *summed* over micro-batches (and, through `grad_scale` = the DP size that
DDP divides by, over DP ranks). Megatron's schedule divides every micro-batch loss by the number
of micro-batches, so the loss handed to it is multiplied by that number first.

Results that exist only on the last stage (log-probs, values, loss metrics) reach the other
stages through `from_last_stage` / `share_per_sample` (a broadcast over the pipeline group, which
holds one rank of every stage with the same TP/DP position).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from rlslurm.trainer import logprobs as lp
from rlslurm.trainer.collectives import collective_device

# (model output on the last stage, the micro-batch) -> (loss share, payload returned to the caller)
LossFn = Callable[[Tensor, Any], tuple[Tensor, Any]]


def _ps():
    from megatron.core import parallel_state as ps

    return ps


def pp_size() -> int:
    ps = _ps()
    return ps.get_pipeline_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1


def is_last_stage() -> bool:
    return pp_size() == 1 or _ps().is_pipeline_last_stage()


def run_microbatches(model: torch.nn.Module, mbs: Sequence[Any], loss_fn: LossFn, *, forward_only: bool,
                     grad_scale: float = 1.0) -> list[Any]:
    """Forward every micro-batch (objects with `.tokens` [n, L]) and, unless `forward_only`, backward
    `grad_scale * loss`. Returns `loss_fn`'s payloads in micro-batch order on the last stage, [] on
    the others. Gradients accumulate; zeroing and the optimizer step are the caller's."""
    if not mbs:
        return []
    if pp_size() == 1:
        payloads = []
        for mb in mbs:
            loss, payload = loss_fn(lp.forward_logits(model, mb), mb)
            if not forward_only:
                (loss * grad_scale).backward()
            payloads.append(payload)
        return payloads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    n = len(mbs)
    # megatron's schedule (forward_step_calc_loss, a (loss, payload) loss_func) also multiplies the
    # loss by the CP size, for losses that are a CP rank's local-token mean; ours is already the
    # whole loss on every CP rank (models/context_parallel.py), so that factor is taken out again
    cp = _ps().get_context_parallel_world_size()

    def forward_step(data_iterator: Iterator[Any], m: torch.nn.Module):
        mb = next(data_iterator)
        output = lp.forward_logits(m, mb)  # a non-first stage ignores the tokens, uses its input tensor

        def loss_func(output_tensor: Tensor):
            loss, payload = loss_fn(output_tensor, mb)
            return loss * (grad_scale * n / cp), payload  # the schedule divides by n, multiplies by CP

        return output, loss_func

    return list(get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(mbs), model=model, num_microbatches=n,
        # unused under variable_seq_lengths (shapes travel with the activations), but required
        seq_length=max(int(mb.tokens.shape[1]) for mb in mbs),
        micro_batch_size=max(int(mb.tokens.shape[0]) for mb in mbs),
        forward_only=forward_only,
    ))


def from_last_stage(t: Tensor) -> Tensor:
    """`t` as the last stage holds it, on every stage (in place; same shape and dtype on all)."""
    if pp_size() > 1:
        ps = _ps()
        dist.broadcast(t, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
    return t


def share_per_sample(values: dict[int, Tensor], order: list[int], lengths: dict[int, int],
                     device: torch.device) -> dict[int, Tensor]:
    """Per-sample fp32 1-D tensors computed on the last stage -> the same dict on every stage.
    `lengths` (known everywhere: response lengths) size the receive buffer of the other stages."""
    if pp_size() == 1:
        return values
    if is_last_stage():
        flat = torch.cat([values[i].reshape(-1).float() for i in order]).to(device) if order else \
            torch.zeros(0, device=device)
    else:
        flat = torch.empty(sum(lengths[i] for i in order), dtype=torch.float32, device=device)
    from_last_stage(flat)
    parts = flat.split([lengths[i] for i in order])
    return {i: p.clone() for i, p in zip(order, parts)}


@dataclass
class _Tokens:
    tokens: Tensor  # [n, L]: all `forward_logits` reads of a micro-batch


def seq_multiple(model: torch.nn.Module) -> int:
    """What padded sequence lengths must be a multiple of: the TP size under sequence parallelism
    (megatron splits the sequence over the TP ranks), else 1; times 2 x CP with context parallelism
    (every sequence is cut into 2 x CP chunks: models/context_parallel.py)."""
    from megatron.core.utils import get_model_config

    config = get_model_config(model)
    tp = config.tensor_model_parallel_size if config.sequence_parallel else 1
    cp = config.context_parallel_size
    return tp * (2 * cp if cp > 1 else 1)


def segment_multiple(model: torch.nn.Module) -> int:
    """What each packed sequence is padded to: 2 x CP with context parallelism, else 1."""
    from megatron.core.utils import get_model_config

    cp = get_model_config(model).context_parallel_size
    return 2 * cp if cp > 1 else 1


def logits_on_every_stage(model: torch.nn.Module, tokens: Tensor) -> Tensor:
    """fp32 output [n, L, V/tp] of the whole pipeline for `tokens`, on every stage (forward only).
    Right-padded to `seq_multiple` inside (causal: the real positions do not see the padding)."""
    length = tokens.shape[1]
    m = seq_multiple(model)
    if length % m:
        tokens = torch.cat([tokens, tokens.new_zeros(tokens.shape[0], m - length % m)], dim=1)
    cp = lp.cp_slice(_Tokens(tokens))  # context parallelism: every CP rank's columns, gathered
    if pp_size() == 1:
        out1 = lp.forward_logits(model, _Tokens(tokens)).float()
        return (out1 if cp is None else cp.gather(out1.contiguous()))[:, :length]
    out = run_microbatches(model, [_Tokens(tokens)],
                           lambda o, mb: (o.new_zeros(()),
                                          (o if cp is None else cp.gather(o.contiguous())).detach().float()),
                           forward_only=True)
    if is_last_stage():
        logits = out[0][:, :length].contiguous()
        shape = torch.tensor(list(logits.shape), dtype=torch.int64, device=logits.device)
    else:
        shape = torch.zeros(3, dtype=torch.int64, device=tokens.device)
    from_last_stage(shape)
    if not is_last_stage():
        logits = torch.empty(shape.tolist(), dtype=torch.float32, device=tokens.device)
    return from_last_stage(logits)


def stages_to_first(stream: Iterable[tuple[str, Tensor]], *, sender: bool) -> Iterator[tuple[str, Tensor]]:
    """The HF export (`mcore_to_hf`) of the whole pipeline on the first stage's `sender` rank.

    With PP > 1 every stage exports only its own layers. The first stage's sender yields its own
    tensors, then each later stage's, received in stage order from that stage's sender (the rank
    at the same TP/DP position, so all senders share one pipeline group); a later stage's sender
    sends its tensors one at a time and yields nothing. Ranks that are not senders get `stream`
    back unchanged: they drain it, which is their part of the TP/EP gathers.
    """
    if pp_size() == 1 or not sender:
        yield from stream
        return
    ps = _ps()
    group = ps.get_pipeline_model_parallel_group()
    stage, stages = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    dev = collective_device()
    if stage > 0:
        first = dist.get_global_rank(group, 0)
        for name, t in stream:
            dist.send_object_list([(name, tuple(t.shape), t.dtype)], dst=first, group=group, device=dev)
            dist.send(t.detach().contiguous().to(dev), dst=first, group=group)
        dist.send_object_list([None], dst=first, group=group, device=dev)
        return
    yield from stream
    for s in range(1, stages):
        src = dist.get_global_rank(group, s)
        while True:
            head: list[Any] = [None]
            dist.recv_object_list(head, src=src, group=group, device=dev)
            if head[0] is None:
                break
            name, shape, dtype = head[0]
            t = torch.empty(shape, dtype=dtype, device=dev)
            dist.recv(t, src=src, group=group)
            yield name, t
