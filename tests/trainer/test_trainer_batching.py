"""Rollout -> optimizer steps -> per-DP-rank micro-batches: coverage, balance, determinism, errors."""

from __future__ import annotations

import numpy as np
import pytest

from rlslurm.errors import ConfigError, DataError
from rlslurm.trainer.batching import balance, collate, micro_batches, plan_batches


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
