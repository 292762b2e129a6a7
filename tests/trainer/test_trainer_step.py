"""One RL rollout through the trainer's real path (megatron-core on CPU, gloo): log-probs equal
HF transformers' on the same weights, and TP=2 / DP=2 give the losses and the update of TP=1. The
TP=2 layout packs its sequences (--qkv-format thd, dynamic batching by real tokens: two or three
samples per row) against TP=1 padded, so it checks tensor parallelism and packing at once (TP=2
padded is checked by the pipeline and expert-parallel tests)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import commit_rollouts, make_run

pytestmark = pytest.mark.megatron

# Entropy bonus and KL loss on: their gradients go through the TP all-reduces too; TIS on the
# engine's (here synthetic) log-probs. A large Adam eps keeps the update linear in tiny gradients:
# with eps=1e-8 a gradient of 1e-9 whose last bit differs between layouts can flip a whole
# lr-sized update, which would make the weight comparison measure Adam, not the trainer.
TRAIN = dict(entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.1, num_steps_per_rollout=2, global_batch_size=4,
             micro_batch_size=2, eps_clip=0.1, lr=3e-3, use_tis=True, tis_clip_low=0.2, tis_clip=2.0, adam_eps=1e-3)


# 4-14 tokens per sample (conftest.make_samples): 24 real tokens make rows of two or three samples.
PACKED = dict(qkv_format="thd", use_dynamic_batch_size=True, max_tokens_per_gpu=24)


def _prepare(tmp: Path, hf: Path, name: str, nproc: int, tp: int, extra: dict | None = None) -> tuple[Path, Path]:
    run = make_run(tmp / name, hf, nproc=nproc, train={**TRAIN, "tensor_model_parallel_size": tp, **(extra or {})})
    commit_rollouts(run, range(1))
    return run, tmp / f"{name}-out"


def step_runs(request: pytest.FixtureRequest, tmp: Path) -> list[tuple]:
    """TP=1; TP=2 packed and DP=2 (tests/trainer/conftest.py step_results: one torchrun per world size
    for the whole session)."""
    hf = request.getfixturevalue("tiny_hf")
    return [(name, nproc, *_prepare(tmp, hf, name, nproc, tp, extra), False)
            for name, nproc, tp, extra in (("tp1", 1, 1, None), ("tp2-thd", 2, 2, PACKED), ("dp2", 2, 1, None))]


@pytest.fixture(scope="module")
def layouts(step_results) -> dict[str, tuple[dict, dict]]:
    return step_results[__name__]


@pytest.mark.parametrize("name", ["tp1", "tp2-thd"])
def test_logprobs_match_hf_transformers(layouts, name: str) -> None:
    res, _ = layouts[name]
    assert res["logprob_scale"] > 1.0  # real log-probs of a 64-token vocabulary, not zeros
    assert res["logprob_max_abs_diff"] < 1e-5, res
    assert res["entropy_max_abs_diff"] < 1e-5, res


def test_steps_take_finite_nontrivial_updates(layouts) -> None:
    res, _ = layouts["tp1"]
    s0, s1 = res["steps"]
    for s in (s0, s1):
        for k in ("loss", "pg_loss", "kl", "entropy", "grad_norm", "ppo_kl", "pg_clipfrac", "tis", "tis_clipfrac"):
            assert math.isfinite(s[k]), (k, s)
    assert s0["grad_norm"] > 0 and abs(s0["ppo_kl"]) < 1e-6  # first step on fresh data: ratio 1
    assert abs(s1["ppo_kl"]) > 1e-5 and s1["kl"] != 0.0     # the first update moved the policy
    assert 0.0 < s0["tis_clipfrac"] < 1.0                    # engine and trainer disagree: some tokens clip


@pytest.mark.parametrize("name", ["tp2-thd", "dp2"])
def test_parallel_layouts_equal_single_process(layouts, name: str) -> None:
    ref_res, ref_w = layouts["tp1"]
    res, w = layouts[name]
    for a, b in zip(ref_res["steps"], res["steps"]):
        for k in ("loss", "pg_loss", "pg_clipfrac", "ppo_kl", "kl", "entropy", "grad_norm", "tokens", "tis",
                  "tis_clipfrac", "train_rollout_logprob_abs_diff"):
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (name, k, a[k], b[k])
    assert set(w) == set(ref_w)
    worst = max(float((w[n] - ref_w[n]).abs().max()) for n in w)
    assert worst < 1e-5, (name, worst)


def test_update_moved_every_trained_tensor(layouts, tiny_hf) -> None:
    from safetensors.torch import load_file

    init = load_file(str(tiny_hf / "model.safetensors"))
    _, w = layouts["tp1"]
    assert set(w) == set(init)
    still = [n for n in w if torch.equal(w[n], init[n])]
    assert not still, still  # every tensor (qk norms included) got a gradient and an update
