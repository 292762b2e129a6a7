"""Rollout -> optimizer steps -> per-DP-rank micro-batches: coverage, balance, determinism, errors,
and equal micro-batch counts on every DP rank (split micro-batches, then weight-zero fillers)."""

from __future__ import annotations

import numpy as np
import pytest

from rlslurm.errors import ConfigError, DataError
from rlslurm.trainer.batching import balance, collate, collate_packed, equalize, micro_batches, plan_batches


def lengths(n: int, seed: int = 0) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(5, 400, n)]


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("dynamic", [None, 900])
def test_every_sample_once_per_rollout_and_steps_in_order(dp: int, dynamic: int | None) -> None:
    L = lengths(64)
    plans = [plan_batches(L, num_steps=4, dp=dp, dp_rank=r, micro_batch_size=2, max_tokens_per_gpu=dynamic)
             for r in range(dp)]
    for k in range(4):
        got = sorted(i for p in plans for mb in p.steps[k] for i in mb)
        assert got == list(range(16 * k, 16 * (k + 1)))  # step k trains exactly its slice of the rollout
    for p in plans:
        for step in p.steps:
            for mb in step:
                if dynamic is None:
                    assert len(mb) == 2
                elif len(mb) > 1:
                    assert len(mb) * max(L[i] for i in mb) <= dynamic


def test_balance_is_better_than_round_robin_and_counts_equal() -> None:
    L = [1000, 900, 10, 10, 10, 10, 800, 700]
    parts = balance(list(range(8)), L, 2)
    assert sorted(len(p) for p in parts) == [4, 4]
    loads = [sum(L[i] for i in p) for p in parts]
    naive = [sum(L[i] for i in range(0, 8, 2)), sum(L[i] for i in range(1, 8, 2))]
    assert max(loads) - min(loads) < max(naive) - min(naive)
    assert max(loads) - min(loads) <= 10
    # one long sample does not leave its rank more than one sample short of the others
    parts = balance(list(range(9)), [1000, 9, 9, 9, 9, 9, 9, 9, 9], 4)
    assert sorted(len(p) for p in parts) == [2, 2, 2, 3] and [0, 8] in parts


def test_plan_is_deterministic() -> None:
    L = lengths(32, seed=5)
    a = plan_batches(L, num_steps=2, dp=2, dp_rank=1, micro_batch_size=1, max_tokens_per_gpu=500)
    b = plan_batches(list(L), num_steps=2, dp=2, dp_rank=1, micro_batch_size=1, max_tokens_per_gpu=500)
    assert a == b


def test_dynamic_packs_similar_lengths_and_isolates_giants() -> None:
    mbs = micro_batches([0, 1, 2, 3, 4], [100, 10, 12, 11, 5000], micro_batch_size=1, max_tokens_per_gpu=40)
    assert mbs[0] == [4]            # longer than the budget on its own: alone, not dropped
    assert [0] in mbs and sorted(i for mb in mbs for i in mb) == [0, 1, 2, 3, 4]
    assert any(len(mb) == 3 for mb in mbs)  # the three short ones share one micro-batch (3 x 12 <= 40)


def test_errors_name_the_flag() -> None:
    with pytest.raises(DataError, match="--num-steps-per-rollout 3"):
        plan_batches(lengths(16), num_steps=3, dp=1, dp_rank=0, micro_batch_size=1)
    with pytest.raises(DataError, match="--global-batch-size is 4"):
        plan_batches(lengths(16), num_steps=2, dp=1, dp_rank=0, micro_batch_size=1, global_batch_size=4)
    with pytest.raises(ConfigError, match="--micro-batch-size 3"):
        plan_batches(lengths(16), num_steps=2, dp=2, dp_rank=0, micro_batch_size=3)


def test_collate_right_pads() -> None:
    import torch

    from rlslurm.buffer import Sample

    s = [Sample(prompt_tokens=[5, 6], response_tokens=[7]), Sample(prompt_tokens=[8], response_tokens=[9, 10, 11])]
    mb = collate(s, [1, 0], torch.device("cpu"))
    assert mb.tokens.tolist() == [[8, 9, 10, 11], [5, 6, 7, 0]]
    assert mb.prompt_lens == [1, 2] and mb.response_lens == [3, 1] and mb.num_tokens == 7


def test_collate_packed_concatenates_and_pads_the_tail_as_a_segment() -> None:
    import torch

    from rlslurm.buffer import Sample
    from rlslurm.trainer.logprobs import packed_positions, response_slices

    s = [Sample(prompt_tokens=[5, 6], response_tokens=[7]), Sample(prompt_tokens=[8], response_tokens=[9, 10, 11])]
    mb = collate_packed(s, [1, 0], torch.device("cpu"), pad_multiple=4)
    assert mb.tokens.tolist() == [[8, 9, 10, 11, 5, 6, 7, 0]]
    assert mb.starts == [0, 4] and mb.cu_seqlens.tolist() == [0, 4, 7, 8] and mb.packed
    assert packed_positions(mb.cu_seqlens, mb.tokens).tolist() == [[0, 1, 2, 3, 0, 1, 2, 0]]
    # position t predicts token t+1: each sample's response positions, none crossing into the next
    per_pos = torch.arange(7.0).unsqueeze(0)
    assert [t.tolist() for t in response_slices(per_pos, mb)] == [[0.0, 1.0, 2.0], [5.0]]
    exact = collate_packed(s, [0, 1], torch.device("cpu"))  # no padding: no tail segment
    assert exact.cu_seqlens.tolist() == [0, 3, 7] and exact.tokens.shape == (1, 7)


def test_context_parallel_segments_and_each_ranks_chunks() -> None:
    """CP=2 (docs/context-parallel.md): each packed sample is padded to a multiple of 2 x CP, and CP rank
    r holds chunks r and 2 CP - 1 - r of every segment (megatron's load-balanced layout)."""
    import torch

    from rlslurm.buffer import Sample
    from rlslurm.models.context_parallel import columns
    from rlslurm.trainer.logprobs import response_slices

    s = [Sample(prompt_tokens=[5, 6], response_tokens=[7]), Sample(prompt_tokens=[8], response_tokens=[9, 10, 11, 12])]
    mb = collate_packed(s, [0, 1], torch.device("cpu"), pad_multiple=8, segment_multiple=4)
    assert mb.tokens.tolist() == [[5, 6, 7, 0, 8, 9, 10, 11, 12, 0, 0, 0, 0, 0, 0, 0]]
    assert mb.starts == [0, 4] and mb.cu_seqlens.tolist() == [0, 4, 12, 16]
    per_pos = torch.arange(15.0).unsqueeze(0)
    assert [t.tolist() for t in response_slices(per_pos, mb)] == [[1.0], [4.0, 5.0, 6.0, 7.0]]
    bounds = mb.cu_seqlens.tolist()
    assert columns(bounds, 2, 0) == [0, 3, 4, 5, 10, 11, 12, 15]
    assert columns(bounds, 2, 1) == [1, 2, 6, 7, 8, 9, 13, 14]
    assert columns([0, 8], 2, 0) == [0, 1, 6, 7]  # a padded row: chunks 0 and 3 of 4


def test_packed_budget_counts_real_tokens() -> None:
    """A long tail of lengths (lognormal, as RL response lengths are): padded, a micro-batch pays its
    longest sample for each of its samples; packed, only the tokens it holds, so the same samples
    fit the fewest micro-batches the budget allows."""
    L = [int(x) for x in np.minimum(np.random.default_rng(0).lognormal(5, 1, 256), 4096) + 20]
    padded = micro_batches(list(range(256)), L, micro_batch_size=1, max_tokens_per_gpu=4096)
    packed = micro_batches(list(range(256)), L, micro_batch_size=1, max_tokens_per_gpu=4096, packed=True)
    assert sorted(i for mb in packed for i in mb) == list(range(256))
    assert all(sum(L[i] for i in mb) <= 4096 for mb in packed)
    assert len(packed) == -(-sum(L) // 4096) == 17 and len(padded) == 20


def _check_plans(L: list[int], num_steps: int, dp: int, mbs: int, budget: int | None, packed: bool = False) -> int:
    """Every invariant of one layout's plans; returns the number of fillers."""
    plans = [plan_batches(L, num_steps=num_steps, dp=dp, dp_rank=r, micro_batch_size=mbs, max_tokens_per_gpu=budget,
                          packed=packed)
             for r in range(dp)]
    cost = (lambda mb: sum(L[i] for i in mb)) if packed else (lambda mb: len(mb) * max(L[i] for i in mb))
    gbs = len(L) // num_steps
    fillers = 0
    for k in range(num_steps):
        shares = balance(list(range(k * gbs, (k + 1) * gbs)), L, dp)
        natural = [len(micro_batches(sh, L, micro_batch_size=mbs, max_tokens_per_gpu=budget, packed=packed))
                   for sh in shares]
        counts = {p.num_microbatches(k) for p in plans}
        assert counts == {max(natural)}, (k, counts, natural)  # equal, and no more than needed
        real = sorted(i for p in plans for mb in p.steps[k] for i in mb)
        assert real == list(range(k * gbs, (k + 1) * gbs))  # every sample once among real micro-batches
        for r, p in enumerate(plans):
            assert all(mb for mb in p.steps[k])
            assert sorted(i for mb in p.steps[k] for i in mb) == shares[r]  # splitting moves no sample
            if budget is not None:
                assert all(len(mb) == 1 or cost(mb) <= budget for mb in p.steps[k])
            elif not p.fillers[k]:
                assert all(len(mb) == mbs for mb in p.steps[k])
            if p.fillers[k]:
                # only where needed: every sample already alone, still short of the target
                assert all(len(mb) == 1 for mb in p.steps[k]) and len(shares[r]) < max(natural)
                assert len(p.fillers[k]) == 1  # shares differ by at most one sample
                assert p.fillers[k][0] == min(shares[r], key=lambda i: (L[i], i))
                fillers += 1
    return fillers


def test_every_rank_runs_the_same_micro_batch_count_random_layouts() -> None:
    """Property test over many random rollouts, DP sizes, budgets (fixed seed)."""
    rng = np.random.default_rng(1234)
    fillers = splits = packs = 0
    for _ in range(400):
        dp = int(rng.integers(1, 9))
        num_steps = int(rng.integers(1, 4))
        gbs = int(rng.integers(dp, 6 * dp + 1))
        hi = int(rng.choice([8, 64, 2000]))
        L = [int(x) for x in rng.integers(1, hi + 1, gbs * num_steps)]
        if rng.random() < 0.2 or gbs % dp:
            budget: int | None = int(rng.integers(1, 4 * hi))
            mbs = 1
        else:
            budget, mbs = None, int(rng.choice([d for d in range(1, gbs // dp + 1) if (gbs // dp) % d == 0]))
        packed = budget is not None and rng.random() < 0.5
        fillers += _check_plans(L, num_steps, dp, mbs, budget, packed)
        if budget is not None:
            splits += 1
            packs += packed
    assert fillers > 10 and splits > 100 and packs > 40  # the cases the property is about did occur


def test_equalize_splits_the_fullest_micro_batch_first_then_fills() -> None:
    L = [9, 8, 7, 6, 5, 4, 3]
    assert equalize([[0, 1, 2, 3], [4, 5]], 3, L) == ([[0, 1], [2, 3], [4, 5]], [])
    assert equalize([[0, 1], [4, 5]], 3, L) == ([[0], [1], [4, 5]], [])  # ties: the first
    assert equalize([[0], [4, 6]], 5, L) == ([[0], [4], [6]], [6, 6])    # shortest sample as filler
    assert equalize([[0, 1]], 1, L) == ([[0, 1]], [])
    with pytest.raises(ValueError, match="cannot equalise 2 micro-batches to 1"):
        equalize([[0], [1]], 1, L)


def test_filler_adds_nothing_to_loss_metrics_or_gradient() -> None:
    """A filler is a real sample with an all-zero mask: its share of every value and its gradient are
    exactly 0, so a step with it equals the step without it (the denominator never sees it)."""
    import torch

    from rlslurm.trainer.losses import PolicyLossConfig, compute_rl_loss

    g = torch.Generator().manual_seed(0)
    n = 7
    for reduction in ("per_sample_mean", "per_token"):
        cfg = PolicyLossConfig(use_tis=True, kl_loss_coef=0.1, entropy_coef=0.01, loss_reduction=reduction)
        logp = (-torch.rand(n, generator=g) * 3).requires_grad_()
        kw = dict(advantages=[torch.randn(n, generator=g)], old_log_probs=[-torch.rand(n, generator=g) * 3],
                  ref_log_probs=[-torch.rand(n, generator=g) * 3], rollout_log_probs=[-torch.rand(n, generator=g) * 3],
                  entropy=[torch.rand(n, generator=g).requires_grad_()], global_denominator=torch.tensor(3.0))
        loss, metrics = compute_rl_loss(cfg, log_probs=[logp], loss_masks=[torch.zeros(n)], **kw)
        loss.backward()
        assert loss.item() == 0.0 and all(v.item() == 0.0 for v in metrics.values()), metrics
        assert torch.equal(logp.grad, torch.zeros(n)) and torch.equal(kw["entropy"][0].grad, torch.zeros(n))
