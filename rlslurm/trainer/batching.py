"""Rollout samples -> optimizer steps -> per-DP-rank micro-batches, deterministically.

A rollout of N samples is split in order into `num_steps_per_rollout` global batches. Each global
batch is spread over the DP ranks balanced by tokens (longest sample first onto the rank with the
fewest tokens so far; counts differ by at most one), then each rank cuts its share into
micro-batches: `micro_batch_size` samples each, or, with dynamic batching, as many samples as fit
in `max_tokens_per_gpu` *padded* tokens (a micro-batch costs n x its longest sample). Every rank
computes the same plan from the sample lengths alone, so no communication is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlslurm.buffer.sample import Sample
from rlslurm.errors import ConfigError, DataError

PAD_ID = 0  # right padding under a causal mask never reaches the real tokens; its value is irrelevant


@dataclass(frozen=True)
class BatchPlan:
    """steps[k][m] = sample indices of micro-batch m of optimizer step k on this DP rank."""

    steps: list[list[list[int]]]
    global_batch_size: int

    def local_indices(self) -> list[int]:
        return [i for step in self.steps for mb in step for i in mb]


def split_steps(n: int, num_steps: int, global_batch_size: int | None, where: str) -> int:
    """The global batch size of a rollout of `n` samples (checked against the config)."""
    if n == 0:
        raise DataError(where, "rollout has no samples")
    if n % num_steps:
        raise DataError(where, f"{n} samples do not split into --num-steps-per-rollout {num_steps} equal steps")
    gbs = n // num_steps
    if global_batch_size is not None and global_batch_size != gbs:
        raise DataError(where, f"{n} samples / --num-steps-per-rollout {num_steps} = {gbs} per step, "
                               f"but --global-batch-size is {global_batch_size}")
    return gbs


def balance(indices: list[int], lengths: list[int], dp: int) -> list[list[int]]:
    """Indices spread over `dp` ranks: equal counts (+-1), greedy-balanced token totals."""
    quota = -(-len(indices) // dp)
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    load = [0] * dp
    out: list[list[int]] = [[] for _ in range(dp)]
    for i in order:
        r = min((r for r in range(dp) if len(out[r]) < quota), key=lambda r: (load[r], r))
        out[r].append(i)
        load[r] += lengths[i]
    return [sorted(o) for o in out]


def micro_batches(indices: list[int], lengths: list[int], *, micro_batch_size: int,
                  max_tokens_per_gpu: int | None) -> list[list[int]]:
    if max_tokens_per_gpu is None:
        return [indices[i: i + micro_batch_size] for i in range(0, len(indices), micro_batch_size)]
    # Longest first: each micro-batch's padding is set by its first sample, so similar lengths pack together.
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    out: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        width = lengths[cur[0]] if cur else lengths[i]
        if cur and (len(cur) + 1) * width > max_tokens_per_gpu:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


def plan_batches(lengths: list[int], *, num_steps: int, dp: int, dp_rank: int, micro_batch_size: int,
                 global_batch_size: int | None = None, max_tokens_per_gpu: int | None = None,
                 where: str = "rollout") -> BatchPlan:
    gbs = split_steps(len(lengths), num_steps, global_batch_size, where)
    if max_tokens_per_gpu is None and gbs % (dp * micro_batch_size):
        raise ConfigError(f"global batch of {gbs} samples is not divisible by DP size {dp} x "
                          f"--micro-batch-size {micro_batch_size} (or use --use-dynamic-batch-size)")
    if gbs < dp:
        raise ConfigError(f"global batch of {gbs} samples is smaller than the DP size {dp}")
    steps = []
    for k in range(num_steps):
        share = balance(list(range(k * gbs, (k + 1) * gbs)), lengths, dp)[dp_rank]
        steps.append(micro_batches(share, lengths, micro_batch_size=micro_batch_size,
                                   max_tokens_per_gpu=max_tokens_per_gpu))
    return BatchPlan(steps=steps, global_batch_size=gbs)


@dataclass
class MicroBatch:
    """Right-padded tokens of some samples, and where each response sits in them."""

    indices: list[int]
    tokens: torch.Tensor          # [n, L] int64
    prompt_lens: list[int]
    response_lens: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(p + r for p, r in zip(self.prompt_lens, self.response_lens))


def collate(samples: list[Sample], indices: list[int], device: torch.device, pad_multiple: int = 1) -> MicroBatch:
    """Right-padded to the longest sample, rounded up to `pad_multiple` (the TP size under sequence
    parallelism, which splits the sequence dimension over TP ranks)."""
    if pad_multiple < 1:
        raise ValueError(f"pad_multiple must be >= 1, got {pad_multiple}")
    seqs = [samples[i].tokens for i in indices]
    width = -(-max(len(s) for s in seqs) // pad_multiple) * pad_multiple
    tokens = torch.full((len(seqs), width), PAD_ID, dtype=torch.long)
    for row, s in enumerate(seqs):
        tokens[row, : len(s)] = torch.from_numpy(s.astype("int64"))
    return MicroBatch(
        indices=list(indices),
        tokens=tokens.to(device),
        prompt_lens=[len(samples[i].prompt_tokens) for i in indices],
        response_lens=[samples[i].response_length for i in indices],
    )
