"""Deterministic rollouts for buffer tests: content is a function of (rollout id, seed), so
any process can check what it reads against what must have been written."""

from __future__ import annotations

import numpy as np

from rlslurm.buffer import Rollout, RolloutMeta, Sample, SampleStatus

STATUSES = list(SampleStatus)


def make_samples(rollout_id: int, n: int = 8, response_len: int = 64, prompt_len: int = 16,
                 seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng([rollout_id, seed])
    out = []
    for i in range(n):
        rl = int(rng.integers(1, response_len + 1))
        mask = np.ones(rl, dtype=np.uint8)
        mask[rl // 2 : rl // 2 + rl // 4] = 0  # a "tool" span that is not trained
        out.append(
            Sample(
                prompt_tokens=rng.integers(0, 150_000, prompt_len),
                response_tokens=rng.integers(0, 150_000, rl),
                reward={"acc": float(rng.integers(0, 2)), "len": -rl / 1000} if i % 2 else float(rng.random()),
                reward_key="acc" if i % 2 else None,
                loss_mask=mask,
                rollout_logprobs=None if i % 3 == 2 else -rng.random(rl).astype(np.float32),
                status=STATUSES[i % len(STATUSES)],
                group_index=i // 4,
                index=i,
                weight_version=rollout_id // 2,
                label=f"label-{rollout_id}-{i}",
                metadata={"turns": i % 3, "src": "unit"},
            )
        )
    return out


def make_meta(rollout_id: int) -> RolloutMeta:
    return RolloutMeta(
        weight_versions=[rollout_id // 2],
        data_cursor={"epoch": 0, "offset": (rollout_id + 1) * 2},
        metrics={"gen_time_s": 1.5 + rollout_id},
    )


def assert_same(rollout: Rollout, expected: list[Sample]) -> None:
    assert len(rollout.samples) == len(expected)
    for got, exp in zip(rollout.samples, expected):
        np.testing.assert_array_equal(got.prompt_tokens, exp.prompt_tokens)
        np.testing.assert_array_equal(got.response_tokens, exp.response_tokens)
        np.testing.assert_array_equal(got.loss_mask, exp.effective_loss_mask())
        if exp.rollout_logprobs is None:
            assert got.rollout_logprobs is None
        else:
            np.testing.assert_array_equal(got.rollout_logprobs, exp.rollout_logprobs)
        assert got.reward == exp.reward
        assert got.reward_key == exp.reward_key
        assert got.status == exp.status
        assert (got.group_index, got.index, got.weight_version) == (exp.group_index, exp.index, exp.weight_version)
        assert got.label == exp.label
        assert got.metadata == exp.metadata
