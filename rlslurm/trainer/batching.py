"""Rollout samples -> optimizer steps -> per-DP-rank micro-batches, deterministically.

A rollout of N samples is split in order into `num_steps_per_rollout` global batches. Each global
batch is spread over the DP ranks balanced by tokens (longest sample first onto the rank with the
fewest tokens so far; counts differ by at most one), then each rank cuts its share into
micro-batches: `micro_batch_size` samples each, or, with dynamic batching, as many samples as fit
in `max_tokens_per_gpu` tokens. Padded (`--qkv-format bshd`, the default) a micro-batch is right-
padded and costs n x its longest sample; packed (`--qkv-format thd`) its samples are concatenated
into one row and it costs the sum of their lengths (docs/sequence-packing.md). Every rank computes
the same plan from the sample lengths alone, so no communication is needed.

Every DP rank runs the same number of micro-batches per optimizer step. With expert parallelism
the token dispatch of every MoE layer is a collective over ranks of different DP index, so a rank
with one micro-batch more than its peers would wait forever in a collective they never enter.
Dynamic batching gives ranks different natural counts, so each step is equalised to the largest
count over the ranks (every rank computes every rank's share, so it knows that count): a rank
below it splits its micro-batch with the most samples in two until it reaches it, and a rank with
fewer samples than the target then runs *filler* micro-batches — its shortest sample again, with
an all-zero loss mask. A filler adds nothing to any loss numerator, the global denominator (it is
not in `BatchPlan.steps`, which the denominators and token counts are taken from) or any metric;
its gradient is exactly zero. Fillers occur at most once per rank and step (shares differ by at
most one sample), only when some rank's every sample is a micro-batch of its own.

This is done always, not only at EP > 1: with fixed micro-batches the counts are already equal
(the global batch must divide into DP x micro_batch_size); with dynamic batching the cost is a few
smaller micro-batches on the rank that had fewer (usually the one with shorter samples, which
would otherwise wait for the others at the step's gradient reduction) and at most one filler; and
a plan that depends on the DP size alone, not on EP, cuts two layouts of the same DP size alike
(same micro-batches, so the same numbers, and the same micro-batch count for a pipeline schedule).
Routers with an expert bias count routed tokens for their load statistic: filler tokens count
there, as padding tokens already do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlslurm.buffer.sample import Sample
from rlslurm.errors import ConfigError, DataError

PAD_ID = 0  # right padding under a causal mask never reaches the real tokens; its value is irrelevant


@dataclass(frozen=True)
class BatchPlan:
    """steps[k][m] = sample indices of micro-batch m of optimizer step k on this DP rank;
    fillers[k] = the samples of step k's filler micro-batches (one sample each, run after the
    real ones with a zero loss mask). Every DP rank has the same `num_microbatches(k)`."""

    steps: list[list[list[int]]]
    global_batch_size: int
    fillers: list[list[int]]

    def local_indices(self) -> list[int]:
        """The samples this rank trains on, each once (fillers are repeats, not included)."""
        return [i for step in self.steps for mb in step for i in mb]

    def num_microbatches(self, k: int) -> int:
        return len(self.steps[k]) + len(self.fillers[k])


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
    # Exactly len % dp ranks get one sample more. A cap of ceil(n / dp) alone is not enough: a rank
    # holding one long sample would stay below the others by more than one.
    base, extra = divmod(len(indices), dp)
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    load = [0] * dp
    out: list[list[int]] = [[] for _ in range(dp)]
    for i in order:
        room = [r for r in range(dp) if len(out[r]) < base or (len(out[r]) == base and extra > 0)]
        r = min(room, key=lambda r: (load[r], r))
        if len(out[r]) == base:
            extra -= 1
        out[r].append(i)
        load[r] += lengths[i]
    return [sorted(o) for o in out]


def micro_batches(indices: list[int], lengths: list[int], *, micro_batch_size: int,
                  max_tokens_per_gpu: int | None, packed: bool = False) -> list[list[int]]:
    if max_tokens_per_gpu is None:
        return [indices[i: i + micro_batch_size] for i in range(0, len(indices), micro_batch_size)]
    # Longest first: padded, each micro-batch's width is set by its first sample, so similar lengths
    # go together; packed, it is first-fit decreasing (a sample goes to the first micro-batch with
    # room), which leaves at most one micro-batch less than half full.
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    out: list[list[int]] = []
    if packed:
        used: list[int] = []
        for i in order:
            m = next((m for m, u in enumerate(used) if u + lengths[i] <= max_tokens_per_gpu), None)
            if m is None:
                out.append([])
                used.append(0)
                m = len(out) - 1
            out[m].append(i)
            used[m] += lengths[i]
        return out
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


def equalize(mbs: list[list[int]], target: int, lengths: list[int]) -> tuple[list[list[int]], list[int]]:
    """`mbs` split up to `target` micro-batches, and the filler samples still missing after that.

    The micro-batch with the most samples (the first of those) is halved, keeping its order, so
    every part still fits the token budget its whole did. Fillers: the shortest sample (lowest
    index on ties), once per missing micro-batch, when every micro-batch holds one sample.
    """
    out = [list(mb) for mb in mbs]
    if not out or len(out) > target:
        raise ValueError(f"cannot equalise {len(out)} micro-batches to {target}")
    while len(out) < target:
        m = max(range(len(out)), key=lambda j: (len(out[j]), -j))
        if len(out[m]) < 2:
            break
        half = (len(out[m]) + 1) // 2
        out[m: m + 1] = [out[m][:half], out[m][half:]]
    shortest = min((i for mb in out for i in mb), key=lambda i: (lengths[i], i))
    return out, [shortest] * (target - len(out))


def plan_batches(lengths: list[int], *, num_steps: int, dp: int, dp_rank: int, micro_batch_size: int,
                 global_batch_size: int | None = None, max_tokens_per_gpu: int | None = None,
                 packed: bool = False, where: str = "rollout") -> BatchPlan:
    gbs = split_steps(len(lengths), num_steps, global_batch_size, where)
    if max_tokens_per_gpu is None and gbs % (dp * micro_batch_size):
        raise ConfigError(f"global batch of {gbs} samples is not divisible by DP size {dp} x "
                          f"--micro-batch-size {micro_batch_size} (or use --use-dynamic-batch-size)")
    if gbs < dp:
        raise ConfigError(f"global batch of {gbs} samples is smaller than the DP size {dp}")
    if not 0 <= dp_rank < dp:
        raise ValueError(f"dp_rank {dp_rank} outside [0, {dp})")
    steps, fillers = [], []
    for k in range(num_steps):
        every = [micro_batches(share, lengths, micro_batch_size=micro_batch_size, max_tokens_per_gpu=max_tokens_per_gpu,
                               packed=packed)
                 for share in balance(list(range(k * gbs, (k + 1) * gbs)), lengths, dp)]
        mbs, fill = equalize(every[dp_rank], max(len(m) for m in every), lengths)
        steps.append(mbs)
        fillers.append(fill)
    return BatchPlan(steps=steps, global_batch_size=gbs, fillers=fillers)


@dataclass
class MicroBatch:
    """The tokens of some samples, and where each sample sits in them: padded, sample k is row k
    from column 0; packed, every sample is in row 0 from column `starts[k]`."""

    indices: list[int]
    tokens: torch.Tensor          # [n, L] int64 padded; [1, T] packed
    prompt_lens: list[int]
    response_lens: list[int]
    filler: bool = False          # run only to keep ranks' collectives aligned: trains nothing
    starts: list[int] | None = None   # packed: each sample's first column in row 0
    cu_seqlens: torch.Tensor | None = None  # packed: int32 [segments + 1], a padding tail is a segment

    @property
    def num_tokens(self) -> int:
        return sum(p + r for p, r in zip(self.prompt_lens, self.response_lens))

    @property
    def packed(self) -> bool:
        return self.starts is not None

    def where(self, k: int) -> tuple[int, int]:
        """(row, first column) of sample k of this micro-batch."""
        return (0, self.starts[k]) if self.starts is not None else (k, 0)


def collate(samples: list[Sample], indices: list[int], device: torch.device, pad_multiple: int = 1,
            filler: bool = False) -> MicroBatch:
    """Right-padded to the longest sample, rounded up to `pad_multiple` (the TP size under sequence
    parallelism, which splits the sequence dimension over TP ranks)."""
    if pad_multiple < 1:
        raise ValueError(f"pad_multiple must be >= 1, got {pad_multiple}")
    seqs = [samples[i].tokens for i in indices]
    width = -(-max(len(s) for s in seqs) // pad_multiple) * pad_multiple
    tokens = torch.full((len(seqs), width), PAD_ID, dtype=torch.long)
    for row, s in enumerate(seqs):
        tokens[row, : len(s)] = torch.from_numpy(s.astype("int64"))
    return _micro_batch(samples, indices, tokens, device, filler)


def collate_packed(samples: list[Sample], indices: list[int], device: torch.device, pad_multiple: int = 1,
                   filler: bool = False, segment_multiple: int = 1) -> MicroBatch:
    """The samples concatenated into one row, padded at the end to `pad_multiple`; the padding is a
    segment of its own in `cu_seqlens`, so no sample attends to it. `segment_multiple` (2 x CP with
    context parallelism, which cuts every sequence into 2 x CP chunks): each sample's segment is
    right-padded to a multiple of it (causal: its tokens do not see their padding)."""
    if pad_multiple < 1 or segment_multiple < 1 or pad_multiple % segment_multiple:
        raise ValueError(f"pad_multiple {pad_multiple} must be a multiple of segment_multiple {segment_multiple} >= 1")
    seqs = [samples[i].tokens for i in indices]
    lens = [-(-len(s) // segment_multiple) * segment_multiple for s in seqs]
    total = sum(lens)
    width = -(-total // pad_multiple) * pad_multiple
    tokens = torch.full((1, width), PAD_ID, dtype=torch.long)
    starts, at = [], 0
    for s, n in zip(seqs, lens):
        tokens[0, at: at + len(s)] = torch.from_numpy(s.astype("int64"))
        starts.append(at)
        at += n
    bounds = [0, *(st + n for st, n in zip(starts, lens))] + ([width] if width > total else [])
    return _micro_batch(samples, indices, tokens, device, filler, starts=starts,
                        cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=device))


def _micro_batch(samples: list[Sample], indices: list[int], tokens: torch.Tensor, device: torch.device,
                 filler: bool, **packed: Any) -> MicroBatch:
    """What `collate` and `collate_packed` share: the samples' lengths beside their token rows."""
    return MicroBatch(
        indices=list(indices),
        tokens=tokens.to(device),
        prompt_lens=[len(samples[i].prompt_tokens) for i in indices],
        response_lens=[samples[i].response_length for i in indices],
        filler=filler,
        **packed,
    )
