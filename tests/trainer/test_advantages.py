"""Advantage estimators against independent references: explicit Python loops in float64 on
small hand-built batches (unequal groups, tool tokens masked out, truncated samples)."""

from __future__ import annotations

import dataclasses
import math
import os
import re

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlslurm.errors import ConfigError, DataError
from rlslurm.net import free_port
from rlslurm.settings.rl_settings import ESTIMATOR_NAMES, estimator
from rlslurm.trainer.advantages import (
    AdvantageConfig,
    actor_trains,
    check_rl_configs,
    compute_advantages_and_returns,
    discounted_cumsum,
    group_baseline,
    masked_whiten,
    reward_from,
    rl_configs_from_train,
)
from rlslurm.trainer.losses import PolicyLossConfig

# Six samples in three prompt groups of unequal size, ids not contiguous and interleaved.
GROUPS = [7, 3, 7, 3, 7, 11]
REWARDS = [1.0, 0.0, 0.0, 1.0, 1.0, 0.5]
# Sample 1 has a tool-output span (zeros) in the middle, sample 3 ends in a masked span,
# sample 4 is a truncated answer (longest, every token trainable), sample 5 is length 1.
MASKS = [
    [1, 1, 1],
    [1, 1, 0, 0, 1, 1],
    [1, 1],
    [1, 1, 1, 0, 0],
    [1, 1, 1, 1, 1, 1, 1, 1],
    [1],
]


def _masks() -> list[torch.Tensor]:
    return [torch.tensor(m, dtype=torch.float32) for m in MASKS]


def _ref_group_norm(rewards: list[float], groups: list[int], divide: bool) -> list[float]:
    out = []
    for r, g in zip(rewards, groups):
        members = [rr for rr, gg in zip(rewards, groups) if gg == g]
        mean = sum(members) / len(members)
        if not divide:
            out.append(r - mean)
            continue
        var = sum((x - mean) ** 2 for x in members) / (len(members) - 1) if len(members) > 1 else 0.0
        out.append((r - mean) / (math.sqrt(var) + 1e-6))
    return out


def _ref_whiten(advs: list[list[float]], masks: list[list[int]]) -> list[list[float]]:
    xs = np.array([a for adv, m in zip(advs, masks) for a, mm in zip(adv, m) if mm], dtype=np.float64)
    mean, std = xs.mean(), math.sqrt(xs.var(ddof=1) + 1e-8)
    return [[(a - mean) / std if mm else 0.0 for a, mm in zip(adv, m)] for adv, m in zip(advs, masks)]


def _run(cfg: AdvantageConfig, **kw):
    kw.setdefault("rewards", torch.tensor(REWARDS))
    kw.setdefault("group_index", torch.tensor(GROUPS))
    kw.setdefault("loss_masks", _masks())
    return compute_advantages_and_returns(cfg, **kw)


def _assert_lists_close(got: list[torch.Tensor], want: list[list[float]], atol: float = 1e-5) -> None:
    assert [g.numel() for g in got] == [len(w) for w in want]
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g.double().numpy(), np.array(w), atol=atol, err_msg=f"sample {i}")


@pytest.mark.parametrize("estimator", ["grpo", "gspo", "cispo"])
@pytest.mark.parametrize("std", [True, False])
def test_group_baseline_per_group_and_zero_on_masked_tokens(estimator: str, std: bool) -> None:
    adv, ret = _run(AdvantageConfig(estimator=estimator, grpo_std_normalization=std))
    scalars = _ref_group_norm(REWARDS, GROUPS, divide=std)
    _assert_lists_close(adv, [[s * mm for mm in m] for s, m in zip(scalars, MASKS)])
    # returns are the unmasked broadcast scalar (what a critic-free estimator regresses to)
    _assert_lists_close(ret, [[s] * len(m) for s, m in zip(scalars, MASKS)])
    # group 7 is {1, 0, 1}: mean 2/3, sample std sqrt(1/3); spelt out so the reference is checked too
    if std:
        assert adv[0][0].item() == pytest.approx((1 - 2 / 3) / (math.sqrt(1 / 3) + 1e-6), rel=1e-5)
    else:
        assert adv[0][0].item() == pytest.approx(1 / 3, rel=1e-5)


def test_zero_std_and_singleton_groups_give_zero_not_nan() -> None:
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.3, 5.0])
    groups = torch.tensor([0, 0, 0, 1, 2])  # group 0 all equal, groups 1 and 2 of one sample
    masks = [torch.ones(4) for _ in range(5)]
    adv, _ = compute_advantages_and_returns(
        AdvantageConfig(estimator="grpo"), rewards=rewards, group_index=groups, loss_masks=masks
    )
    for a in adv:
        assert torch.isfinite(a).all()
        assert torch.equal(a, torch.zeros(4))


def test_rewards_normalization_off_broadcasts_raw_reward() -> None:
    adv, _ = _run(AdvantageConfig(estimator="grpo", rewards_normalization=False))
    _assert_lists_close(adv, [[r * mm for mm in m] for r, m in zip(REWARDS, MASKS)])


@pytest.mark.parametrize("name", ESTIMATOR_NAMES)
@pytest.mark.parametrize("std", [True, False])
def test_baseline_over_the_rollout_then_a_call_without_it_is_one_call(name: str, std: bool) -> None:
    """The trainer's split (trainer/step.py: `group_baseline` over the whole rollout, then the
    per-rank call with --no-rewards-normalization) gives bit for bit what one call gives."""
    est = estimator(name)
    cfg = AdvantageConfig(estimator=name, grpo_std_normalization=std, normalize_advantages=est.needs_whitening)
    rewards, groups = torch.tensor(REWARDS), torch.tensor(GROUPS)
    baselined = group_baseline(cfg, rewards, groups)
    if est.group_baseline:
        np.testing.assert_allclose(baselined.double().numpy(),
                                   _ref_group_norm(REWARDS, GROUPS, divide=std and est.group_std), atol=1e-6)
    else:
        assert torch.equal(baselined, rewards)
    kw = {"values": [torch.linspace(-1, 1, len(m)) for m in MASKS]} if est.critic else {}
    one_adv, one_ret = _run(cfg, **kw)
    split_adv, split_ret = _run(dataclasses.replace(cfg, rewards_normalization=False), rewards=baselined, **kw)
    for a, b in zip(one_adv + one_ret, split_adv + split_ret):
        assert torch.equal(a, b)


def _ref_kl_k1(lp: list[list[float]], ref: list[list[float]], masks) -> list[list[float]]:
    return [[(a - b) * mm for a, b, mm in zip(x, y, m)] for x, y, m in zip(lp, ref, masks)]


def _random_logps(seed: int) -> list[list[float]]:
    g = torch.Generator().manual_seed(seed)
    return [(-torch.rand(len(m), generator=g, dtype=torch.float64) * 3).tolist() for m in MASKS]


def test_reinforce_plus_plus_discounts_kl_shaped_rewards_then_whitens() -> None:
    gamma, kl_coef = 0.9, 0.1
    lp, ref = _random_logps(1), _random_logps(2)
    kl = _ref_kl_k1(lp, ref, MASKS)
    want_returns = []
    for r, m, k in zip(REWARDS, MASKS, kl):
        token_r = [-kl_coef * x for x in k]
        last = max(i for i, mm in enumerate(m) if mm)  # reward on the last trainable token
        token_r[last] += r
        g, out = 0.0, [0.0] * len(m)
        for t in reversed(range(len(m))):
            g = token_r[t] + gamma * g
            out[t] = g
        want_returns.append(out)
    cfg = AdvantageConfig(estimator="reinforce_plus_plus", kl_coef=kl_coef, gamma=gamma, normalize_advantages=True)
    adv, ret = _run(
        cfg,
        log_probs=[torch.tensor(x, dtype=torch.float32) for x in lp],
        ref_log_probs=[torch.tensor(x, dtype=torch.float32) for x in ref],
    )
    _assert_lists_close(ret, want_returns)
    _assert_lists_close(adv, _ref_whiten(want_returns, MASKS), atol=1e-4)
    # sample 3 ends in masked tokens: the reward sits at index 2, nothing flows back from 3, 4
    assert ret[3][3].item() == 0.0 and ret[3][4].item() == 0.0
    assert ret[3][2].item() == pytest.approx(REWARDS[3] - kl_coef * kl[3][2], abs=1e-6)


def test_reinforce_plus_plus_baseline_subtracts_group_mean_only() -> None:
    kl_coef = 0.05
    lp, ref = _random_logps(3), _random_logps(4)
    kl = _ref_kl_k1(lp, ref, MASKS)
    centred = _ref_group_norm(REWARDS, GROUPS, divide=False)  # no std division for ++baseline
    raw = [[c - kl_coef * k for k in ks] for c, ks in zip(centred, kl)]
    cfg = AdvantageConfig(estimator="reinforce_plus_plus_baseline", kl_coef=kl_coef, normalize_advantages=True)
    adv, ret = _run(
        cfg,
        log_probs=[torch.tensor(x, dtype=torch.float32) for x in lp],
        ref_log_probs=[torch.tensor(x, dtype=torch.float32) for x in ref],
    )
    _assert_lists_close(ret, raw)
    _assert_lists_close(adv, _ref_whiten(raw, MASKS), atol=1e-4)


@pytest.mark.parametrize("kl_estimator", ["k1", "k3"])
def test_ppo_gae_matches_a_loop(kl_estimator: str) -> None:
    gamma, lam, kl_coef = 0.95, 0.8, 0.2
    lp, ref = _random_logps(5), _random_logps(6)
    g = torch.Generator().manual_seed(7)
    values = [torch.randn(len(m), generator=g, dtype=torch.float64).tolist() for m in MASKS]

    def kl_fn(a: float, b: float) -> float:
        return a - b if kl_estimator == "k1" else math.exp(b - a) - 1 - (b - a)

    want_adv, want_ret = [], []
    for r, m, v, x, y in zip(REWARDS, MASKS, values, lp, ref):
        T = len(m)
        token_r = [-kl_coef * kl_fn(a, b) * mm for a, b, mm in zip(x, y, m)]
        token_r[max(i for i in range(T) if m[i])] += r
        adv = [0.0] * T
        last = 0.0
        for t in reversed(range(T)):
            nv = v[t + 1] if t + 1 < T else 0.0  # every response ends its episode
            delta = token_r[t] + gamma * nv - v[t]
            last = delta + gamma * lam * last
            adv[t] = last
        want_adv.append([a * mm for a, mm in zip(adv, m)])
        want_ret.append([a + vv for a, vv in zip(adv, v)])

    cfg = AdvantageConfig(estimator="ppo", kl_coef=kl_coef, kl_estimator=kl_estimator, gamma=gamma, lam=lam)
    adv, ret = _run(
        cfg,
        log_probs=[torch.tensor(x, dtype=torch.float32) for x in lp],
        ref_log_probs=[torch.tensor(x, dtype=torch.float32) for x in ref],
        values=[torch.tensor(x, dtype=torch.float32) for x in values],
    )
    _assert_lists_close(adv, want_adv)
    _assert_lists_close(ret, want_ret)


def test_ppo_lambda_one_gamma_one_is_monte_carlo_minus_value() -> None:
    # With gamma = lam = 1 and no KL, A_t = R - V_t exactly (hand-derived, independent of GAE).
    values = [torch.tensor([0.5, -0.25, 2.0]), torch.tensor([1.0])]
    adv, ret = compute_advantages_and_returns(
        AdvantageConfig(estimator="ppo"),
        rewards=torch.tensor([3.0, -1.0]),
        group_index=torch.tensor([0, 0]),
        loss_masks=[torch.ones(3), torch.ones(1)],
        values=values,
    )
    _assert_lists_close(adv, [[2.5, 3.25, 1.0], [-2.0]])
    _assert_lists_close(ret, [[3.0, 3.0, 3.0], [-1.0]])


@pytest.mark.parametrize("discount", [0.0, 0.7, 0.999, 1.0])
def test_discounted_cumsum_across_chunk_boundaries(discount: float) -> None:
    x = torch.randn(2, 301, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    want = np.zeros((2, 301))
    for b in range(2):
        g = 0.0
        for t in reversed(range(301)):
            g = float(x[b, t]) + discount * g
            want[b, t] = g
    got = discounted_cumsum(x.float(), discount, chunk=64)
    np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-4, atol=1e-4)


def test_whitening_ignores_masked_tokens_and_uses_unbiased_var() -> None:
    vals = [torch.tensor([1.0, 100.0, 3.0]), torch.tensor([5.0])]
    masks = [torch.tensor([1.0, 0.0, 1.0]), torch.tensor([1.0])]
    out = masked_whiten(vals, masks)
    # masked values {1, 3, 5}: mean 3, sample var 4 -> (x - 3) / 2
    assert out[0][0].item() == pytest.approx(-1.0, abs=1e-6)
    assert out[0][2].item() == pytest.approx(0.0, abs=1e-6)
    assert out[1][0].item() == pytest.approx(1.0, abs=1e-6)


def test_fully_masked_sample_gets_zero_advantage() -> None:
    adv, _ = compute_advantages_and_returns(
        AdvantageConfig(estimator="reinforce_plus_plus", normalize_advantages=True),
        rewards=torch.tensor([1.0, 0.0, 2.0]),
        group_index=torch.tensor([0, 0, 0]),
        loss_masks=[torch.zeros(3), torch.ones(2), torch.ones(2)],
    )
    assert torch.equal(adv[0], torch.zeros(3))
    assert all(torch.isfinite(a).all() for a in adv)


def _whiten_worker(rank: int, port: int, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        # Rank r holds half of a DP-sharded batch; whitening must use the global statistics.
        shards = [
            ([torch.tensor([1.0, 2.0, 9.0])], [torch.tensor([1.0, 1.0, 0.0])]),
            ([torch.tensor([4.0]), torch.tensor([8.0, 0.0])], [torch.ones(1), torch.ones(2)]),
        ]
        vals, masks = shards[rank]
        q.put((rank, [t.tolist() for t in masked_whiten(vals, masks, dist.group.WORLD)]))
    finally:
        dist.destroy_process_group()


def test_whitening_statistics_are_global_across_data_parallel_ranks() -> None:
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_whiten_worker, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=60) for _ in range(2))
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    whole = masked_whiten(
        [torch.tensor([1.0, 2.0, 9.0]), torch.tensor([4.0]), torch.tensor([8.0, 0.0])],
        [torch.tensor([1.0, 1.0, 0.0]), torch.ones(1), torch.ones(2)],
    )
    np.testing.assert_allclose(got[0][0], whole[0].tolist(), atol=1e-6)
    np.testing.assert_allclose(got[1][0], whole[1].tolist(), atol=1e-6)
    np.testing.assert_allclose(got[1][1], whole[2].tolist(), atol=1e-6)
    # and that differs from whitening each shard alone (else this test could not fail)
    alone = masked_whiten([torch.tensor([1.0, 2.0, 9.0])], [torch.tensor([1.0, 1.0, 0.0])])
    assert not np.allclose(alone[0].tolist(), got[0][0], atol=1e-3)


# ---------------------------------------------------------------------------------------------
# configuration and input errors
# ---------------------------------------------------------------------------------------------


def test_gspo_must_be_set_in_both_configs() -> None:
    with pytest.raises(ConfigError, match="gspo"):
        check_rl_configs(AdvantageConfig(estimator="gspo"), PolicyLossConfig(estimator="grpo"))
    with pytest.raises(ConfigError, match="cispo"):
        check_rl_configs(AdvantageConfig(estimator="grpo"), PolicyLossConfig(estimator="cispo"))


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"estimator": "a2c"}, "--advantage-estimator"),
        ({"estimator": "ppo", "kl_coef": -1.0}, "--kl-coef"),
        ({"estimator": "ppo", "kl_estimator": "k4"}, "--kl-loss-type"),
        ({"estimator": "ppo", "gamma": 1.5}, "--gamma"),
        ({"estimator": "ppo", "lam": -0.1}, "--lambd"),
    ],
)
def test_bad_advantage_config_names_the_flag(kwargs: dict, flag: str) -> None:
    # rules across settings are rlslurm/settings/rl_settings.py's (tests/settings/test_validation.py)
    with pytest.raises(ConfigError, match=flag):
        AdvantageConfig(**kwargs)


def test_critic_only_warmup() -> None:
    cfg = AdvantageConfig(estimator="ppo", num_critic_only_steps=2)
    assert [actor_trains(cfg, i) for i in range(4)] == [False, False, True, True]
    assert actor_trains(AdvantageConfig(estimator="grpo"), 0)


def test_reward_from() -> None:
    assert reward_from(0.5, None) == 0.5
    assert reward_from(True, None) == 1.0
    assert reward_from({"acc": 1, "fmt": 0.2}, "fmt") == 0.2
    with pytest.raises(DataError, match=r"buf.jsonl:3: .*--reward-key"):
        reward_from({"acc": 1}, None, where="buf.jsonl:3")
    with pytest.raises(DataError, match=r"--reward-key 'x' is not in .*acc"):
        reward_from({"acc": 1}, "x")
    with pytest.raises(DataError, match="non-finite"):
        reward_from(float("nan"), None)
    with pytest.raises(DataError, match="must be a number"):
        reward_from({"acc": "yes"}, "acc")


def test_bad_batches_are_refused() -> None:
    with pytest.raises(ValueError, match="sample 1"):
        compute_advantages_and_returns(
            AdvantageConfig(), rewards=torch.tensor([0.0, float("inf")]), group_index=torch.tensor([0, 0]),
            loss_masks=[torch.ones(2), torch.ones(2)],
        )
    with pytest.raises(ValueError, match="values"):
        compute_advantages_and_returns(
            AdvantageConfig(estimator="ppo"), rewards=torch.tensor([0.0]), group_index=torch.tensor([0]),
            loss_masks=[torch.ones(2)],
        )
    with pytest.raises(ValueError, match=r"values\[0\] has shape"):
        compute_advantages_and_returns(
            AdvantageConfig(estimator="ppo"), rewards=torch.tensor([0.0]), group_index=torch.tensor([0]),
            loss_masks=[torch.ones(2)], values=[torch.ones(3)],
        )


def test_configs_from_the_run_config_train_section() -> None:
    from rlslurm.settings.config import TrainSection

    adv, loss = rl_configs_from_train(TrainSection())
    assert adv.estimator == "grpo" and adv.grpo_std_normalization and loss.loss_reduction == "per_sample_mean"
    assert loss.clip_high == loss.eps_clip and loss.kl_loss_coef == 0.0

    t = TrainSection(advantage_estimator="ppo", lambd=0.9, gamma=0.99, calculate_per_token_loss=True,
                     kl_loss_coef=0.5, use_kl_loss=False, tis_clip=1.5, use_tis=True, eps_clip_high=0.28)
    adv, loss = rl_configs_from_train(t)
    assert (adv.lam, adv.gamma, loss.loss_reduction) == (0.9, 0.99, "per_token")
    assert loss.kl_loss_coef == 0.0  # --kl-loss-coef only counts with --use-kl-loss
    assert (loss.tis_clip_high, loss.clip_high, loss.estimator) == (1.5, 0.28, "ppo")

    # the trainer re-runs the submit-time validator (rlslurm/settings/rl_settings.py)
    with pytest.raises(ConfigError, match="--kl-coef .*--use-kl-loss --kl-loss-coef"):
        rl_configs_from_train(TrainSection(advantage_estimator="ppo", kl_coef=0.1, use_kl_loss=True, kl_loss_coef=0.1))
    with pytest.raises(ConfigError, match="--use-tis and --use-rollout-logprobs"):
        rl_configs_from_train(TrainSection(use_rollout_logprobs=True, use_tis=True))


# ---------------------------------------------------------------------------------------------
# --custom-advantage-function-path
# ---------------------------------------------------------------------------------------------

_CUSTOM = '''
import torch

def discounted_to_go(inputs):
    """Per token: the reward discounted by 0.5 per token before the last masked one, minus the KL."""
    advs = []
    for r, m, k in zip(inputs.rewards.tolist(), inputs.loss_masks, inputs.kl):
        last = int(torch.nonzero(m)[-1])
        steps = (last - torch.arange(m.numel())).clamp_min(0).float()
        advs.append(r * 0.5 ** steps - k)
    return advs, [a + 1.0 for a in advs]
'''


def _f32(xs: list[list[float]]) -> list[torch.Tensor]:
    return [torch.tensor(x, dtype=torch.float32) for x in xs]


def _custom_plugin(tmp_path, body: str = _CUSTOM) -> str:
    f = tmp_path / "adv_plugin.py"
    f.write_text(body)
    return f"{f}:discounted_to_go"


@pytest.mark.parametrize("whiten", [False, True])
def test_custom_advantage_function_replaces_the_estimator(tmp_path, whiten: bool) -> None:
    rewards, groups = [1.0, 0.0, 3.0], [0, 0, 1]
    masks = [[1, 1, 0, 1], [1, 0], [0, 1, 1]]
    lp = [[-1.0, -0.5, -2.0, -0.3], [-0.2, -1.1], [-0.7, -0.4, -0.9]]
    ref = [[-1.2, -0.5, -1.0, -0.1], [-0.3, -1.0], [-0.2, -0.6, -0.8]]
    cfg = AdvantageConfig(estimator="grpo", kl_coef=0.1, kl_estimator="k1", normalize_advantages=whiten,
                          custom_advantage_function_path=_custom_plugin(tmp_path))
    adv, ret = compute_advantages_and_returns(
        cfg, rewards=torch.tensor(rewards), group_index=torch.tensor(groups), loss_masks=_f32(masks),
        log_probs=_f32(lp), ref_log_probs=_f32(ref))
    # float64 reference: the plugin's rule on the group-normalised rewards and the masked k1 KL
    base = _ref_group_norm(rewards, groups, divide=True)
    want = []
    for r, m, a, b in zip(base, masks, lp, ref):
        last = max(i for i, k in enumerate(m) if k)
        want.append([r * 0.5 ** max(last - t, 0) - (a[t] - b[t]) * m[t] for t in range(len(m))])
    want_ret = [[w + 1.0 for w in ws] for ws in want]
    if whiten:
        want = _ref_whiten(want, masks)
    for got, w, m in zip(adv, want, masks):
        np.testing.assert_allclose(got.tolist(), [x * k for x, k in zip(w, m)], rtol=1e-5, atol=1e-6)
    for got, w in zip(ret, want_ret):
        np.testing.assert_allclose(got.tolist(), w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("body,why", [
    ("def discounted_to_go(inputs):\n    return inputs.loss_masks\n", "must return (advantages, returns)"),
    ("def discounted_to_go(inputs):\n    return [m[:1] for m in inputs.loss_masks], inputs.loss_masks\n",
     "advantages[0] has shape (1,)"),
    ("def discounted_to_go(inputs):\n    a = [m / 0 for m in inputs.loss_masks]\n    return a, a\n",
     "advantages[0] is not finite"),
])
def test_custom_advantage_function_output_is_checked(tmp_path, body: str, why: str) -> None:
    cfg = AdvantageConfig(custom_advantage_function_path=_custom_plugin(tmp_path, body))
    with pytest.raises(ConfigError, match=re.escape(why)) as e:
        compute_advantages_and_returns(cfg, rewards=torch.tensor([1.0]), group_index=torch.tensor([0]),
                                       loss_masks=[torch.ones(2)])
    assert "--custom-advantage-function-path" in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------
# --custom-reward-post-process-path
# ---------------------------------------------------------------------------------------------

_POST = '''
import torch

def length_penalised(samples, rewards):
    """slime-style: raw reward minus 0.1 per response token, no group baseline."""
    return rewards - 0.1 * torch.tensor([float(s.response_length) for s in samples])
'''


def test_reward_post_process_takes_the_place_of_the_group_baseline(tmp_path) -> None:
    """From the run config to the trainer's rewards (trainer/step.py rewards_of): the plugin gets the
    rollout's samples and raw rewards; its answer replaces the GRPO normalisation."""
    from types import SimpleNamespace

    from rlslurm.buffer.sample import Sample
    from rlslurm.settings.config import RunConfig, TrainSection
    from rlslurm.trainer.advantages import rl_configs_from_train
    from rlslurm.trainer.step import rewards_of

    (tmp_path / "post.py").write_text(_POST)
    raw, lengths = [1.0, 0.0, 1.0, 1.0], [2, 5, 1, 3]
    samples = [Sample(prompt_tokens=np.array([1], dtype=np.int32), response_tokens=np.arange(n, dtype=np.int32) + 4,
                      reward=r, index=i, group_index=i // 2) for i, (r, n) in enumerate(zip(raw, lengths))]
    rollout = SimpleNamespace(samples=samples, rollout_id=0)
    for spec, want in ((None, _ref_group_norm(raw, [0, 0, 1, 1], divide=True)),
                       (f"{tmp_path / 'post.py'}:length_penalised", [r - 0.1 * n for r, n in zip(raw, lengths)])):
        cfg = RunConfig(train=TrainSection(custom_reward_post_process_path=spec))
        adv, _ = rl_configs_from_train(cfg.train)
        got = rewards_of(SimpleNamespace(cfg=cfg, adv_cfg=adv), rollout)
        np.testing.assert_allclose(got.tolist(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("body,why", [
    ("def f(samples, rewards):\n    return rewards[:1]\n", "returned 1 rewards for 3 samples"),
    ("def f(samples, rewards):\n    return rewards / 0\n", "reward 0 is inf"),
    ("def f(samples, rewards):\n    return 'x'\n", "returned str"),
])
def test_reward_post_process_output_is_checked(tmp_path, body: str, why: str) -> None:
    from rlslurm.trainer.advantages import post_processed_rewards

    (tmp_path / "bad_post.py").write_text(body)
    spec = f"{tmp_path / 'bad_post.py'}:f"
    with pytest.raises(ConfigError, match=re.escape(why)) as e:
        post_processed_rewards(spec, [None] * 3, torch.tensor([1.0, 2.0, 3.0]))
    assert f"--custom-reward-post-process-path {spec}" in str(e.value) and "\n" not in str(e.value)
