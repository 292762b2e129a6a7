from __future__ import annotations

import numpy as np
import pytest
from safetensors import safe_open

from rlslurm.buffer import RolloutReader, RolloutWriter, Sample
from rlslurm.buffer.codec import decode, encode
from rlslurm.errors import DataError

from .helpers import assert_same, make_meta, make_samples


def test_roundtrip_every_field(run):
    samples = make_samples(3, n=12)
    RolloutWriter(run).commit(3, samples, make_meta(3))
    got = RolloutReader(run).read(3)
    assert_same(got, samples)
    assert got.meta.data_cursor == {"epoch": 0, "offset": 8}
    assert got.meta.weight_versions == [1]
    assert got.stats.n_samples == 12 and got.stats.n_groups == 3
    rewards = [s.scalar_reward for s in samples]
    assert got.stats.reward_mean == pytest.approx(np.mean(rewards))
    assert got.stats.truncation_rate == pytest.approx(3 / 12)
    assert not got.samples[0].response_tokens.flags.writeable  # views into the read buffer


def test_data_file_is_plain_safetensors(run):
    samples = make_samples(0, n=5)
    info = RolloutWriter(run).commit(0, samples)
    with safe_open(str(info.data_path), "np") as f:
        toks = f.get_tensor("response_tokens")
        offs = f.get_tensor("response_offsets")
        assert f.metadata()["format"] == "rlslurm-rollout-v1"
    np.testing.assert_array_equal(toks[offs[1] : offs[2]], samples[1].response_tokens)


def test_empty_response_and_no_logprobs_at_all():
    samples = [Sample(prompt_tokens=[1, 2], response_tokens=[]), Sample(prompt_tokens=[], response_tokens=[5], index=1)]
    enc = encode(samples)
    got = decode(b"".join(bytes(c) for c in enc.chunks), "mem")
    assert got[0].response_length == 0 and got[1].prompt_tokens.size == 0
    assert got[1].rollout_logprobs is None
    assert got[1].loss_mask.tolist() == [1]


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(loss_mask=[1, 1]), "loss_mask has 2 entries but the response has 3"),
        (dict(loss_mask=[1, 2, 1]), "only 0 and 1"),
        (dict(rollout_logprobs=[0.0]), "rollout_logprobs has 1 entries"),
        (dict(reward={"a": 1.0}), "reward_key is not set"),
        (dict(reward={"a": 1.0}, reward_key="b"), "reward_key 'b' not in"),
        (dict(reward="high"), "must be a number"),
        (dict(reward=float("nan")), "reward is nan"),
    ],
)
def test_bad_sample_is_named(run, bad, match):
    samples = make_samples(0, n=3)
    samples.append(Sample(prompt_tokens=[1], response_tokens=[1, 2, 3], **bad))
    with pytest.raises(DataError, match="rollout 4 sample 3") as ei:
        RolloutWriter(run).commit(4, samples)
    assert match in str(ei.value)
    assert RolloutReader(run).committed_ids() == []


def test_unserialisable_metadata_is_a_clear_error(run):
    s = Sample(prompt_tokens=[1], response_tokens=[2], metadata={"obj": object()})
    with pytest.raises(DataError, match="JSON-serialisable"):
        RolloutWriter(run).commit(0, [s])


def test_decode_rejects_foreign_file():
    with pytest.raises(DataError, match="somefile: not a valid rollout data file"):
        decode(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ", "somefile")
