"""RL losses against hand-derived numbers (clip edges) and independent float64 loop references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rlslurm.errors import ConfigError
from rlslurm.trainer.actor_loss import LossInputs, loss_function, metric_keys
from rlslurm.trainer.losses import (
    PolicyLossConfig,
    clipped_surrogate,
    compute_rl_loss,
    compute_value_loss,
    entropy_from_logits,
    gspo_policy_loss,
    kl_estimate,
    local_denominator,
    policy_loss,
    reduce_masked,
    tis_weights,
    value_loss,
)

# ---------------------------------------------------------------------------------------------
# KL estimators
# ---------------------------------------------------------------------------------------------


def test_kl_estimators_per_token_formulas() -> None:
    lp = torch.tensor([-1.0, -2.0, -0.5, -3.0], dtype=torch.float64)
    ref = torch.tensor([-1.0, -1.0, -2.5, -0.1], dtype=torch.float64)
    for i in range(4):
        d = float(lp[i] - ref[i])
        assert kl_estimate(lp, ref, "k1")[i].item() == pytest.approx(d, abs=1e-6)
        assert kl_estimate(lp, ref, "k2")[i].item() == pytest.approx(d * d / 2, abs=1e-6)
        assert kl_estimate(lp, ref, "k3")[i].item() == pytest.approx(math.exp(-d) - 1 + d, abs=1e-5)
    # identical policies: every estimator is exactly 0; k2 and k3 are never negative
    for kind in ("k1", "k2", "k3", "low_var_kl"):
        assert torch.equal(kl_estimate(lp, lp, kind), torch.zeros(4))
    assert (kl_estimate(lp, ref, "k3") >= 0).all() and (kl_estimate(lp, ref, "k2") >= 0).all()


def test_k1_and_k3_are_unbiased_for_the_exact_kl() -> None:
    # E_{x~p}[k(x)] over a full categorical equals KL(p||q) = sum p log(p/q) for k1 and k3.
    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(50, generator=g, dtype=torch.float64), 0)
    logq = torch.log_softmax(torch.randn(50, generator=g, dtype=torch.float64), 0)
    p = logp.exp().numpy()
    exact = float(np.sum(p * (logp.numpy() - logq.numpy())))
    for kind in ("k1", "k3"):
        assert float((p * kl_estimate(logp, logq, kind).double().numpy()).sum()) == pytest.approx(exact, rel=1e-5)
    # k2 is biased (its expectation is a different divergence): make sure the check can tell
    assert float((p * kl_estimate(logp, logq, "k2").double().numpy()).sum()) != pytest.approx(exact, rel=1e-2)


def test_low_var_kl_is_clamped_and_k3_is_not() -> None:
    lp, ref = torch.tensor([-20.0]), torch.tensor([-1.0])  # k3 = e^19 - 1 - 19, huge
    assert kl_estimate(lp, ref, "low_var_kl").item() == 10.0
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx(math.exp(19) - 20, rel=1e-5)
    assert kl_estimate(lp, ref, "k3", clamp=5.0).item() == 5.0
    assert kl_estimate(torch.tensor([-1.0]), torch.tensor([-30.0]), "k1", clamp=3.0).item() == 3.0


# ---------------------------------------------------------------------------------------------
# Clipped surrogate: hand-derived edges (eps_clip 0.2, clip-higher 0.28, dual-clip c = 3)
# ---------------------------------------------------------------------------------------------

LOW, HIGH = 0.2, 0.28


def _surrogate(ratios: list[float], advs: list[float], c: float | None = None):
    r = torch.tensor(ratios, dtype=torch.float64)
    a = torch.tensor(advs, dtype=torch.float64)
    loss, clip = clipped_surrogate(r, a, LOW, HIGH, c)
    return loss.tolist(), clip.tolist()


def test_positive_advantage_clips_only_above_one_plus_eps_high() -> None:
    # A = +1: loss = -min(r, clamp(r)). Low ratios are not clipped (pessimism keeps -r).
    ratios = [1 - LOW, 0.79, 1.0, 1.2, 1 + HIGH, 1.29, 3.0]
    loss, clip = _surrogate(ratios, [1.0] * len(ratios))
    assert loss == pytest.approx([-0.8, -0.79, -1.0, -1.2, -1.28, -1.28, -1.28])
    # exactly at the boundary 1 + eps_high is not clipped; 1.2 is inside thanks to clip-higher
    assert clip == [0, 0, 0, 0, 0, 1, 1]


def test_negative_advantage_clips_only_below_one_minus_eps() -> None:
    ratios = [0.5, 0.79, 1 - LOW, 1.0, 1.29, 3.0]
    loss, clip = _surrogate(ratios, [-1.0] * len(ratios))
    assert loss == pytest.approx([0.8, 0.8, 0.8, 1.0, 1.29, 3.0])
    assert clip == [1, 1, 0, 0, 0, 0]


def test_clip_higher_is_asymmetric() -> None:
    # symmetric eps 0.2 would clip r = 1.25 for A > 0; eps_high = 0.28 does not, eps low still 0.2
    loss_sym, clip_sym = clipped_surrogate(torch.tensor([1.25, 0.75]), torch.tensor([1.0, -1.0]), 0.2, 0.2)
    loss_hi, clip_hi = clipped_surrogate(torch.tensor([1.25, 0.75]), torch.tensor([1.0, -1.0]), 0.2, 0.28)
    assert clip_sym.tolist() == [1, 1] and clip_hi.tolist() == [0, 1]
    assert loss_sym.tolist() == pytest.approx([-1.2, 0.8]) and loss_hi.tolist() == pytest.approx([-1.25, 0.8])


def test_dual_clip_caps_negative_advantages_only() -> None:
    loss, _ = _surrogate([5.0, 2.0, 5.0, 5.0, 0.5], [-1.0, -1.0, -2.0, 1.0, -1.0], c=3.0)
    # A=-1, r=5: max(5, 1.28)=5 capped to 3. r=2 < c: untouched. A=-2: 10 capped to 6.
    # A=+1: -1.28 untouched. r=0.5 (< 1-eps): 0.8, below the cap.
    assert loss == pytest.approx([3.0, 2.0, 6.0, -1.28, 0.8])


def test_policy_loss_gradient_is_zero_on_clipped_tokens() -> None:
    old = torch.zeros(4, dtype=torch.float64)
    # ratios 1.5 (clipped, A>0), 1.1 (inside), 0.5 (clipped, A<0), 0.5 (A>0, inside by pessimism)
    lp = torch.log(torch.tensor([1.5, 1.1, 0.5, 0.5], dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([1.0, 2.0, -1.0, 3.0], dtype=torch.float64)
    loss, clip, ppo_kl = policy_loss(lp, old, adv, LOW, HIGH)
    loss.sum().backward()
    # d(-r A)/d logp = -r A on live tokens
    assert lp.grad.tolist() == pytest.approx([0.0, -2.2, 0.0, -1.5])
    assert clip.tolist() == [1, 0, 1, 0]
    assert ppo_kl.tolist() == pytest.approx((-torch.log(torch.tensor([1.5, 1.1, 0.5, 0.5]))).tolist(), abs=1e-6)


# ---------------------------------------------------------------------------------------------
# GSPO
# ---------------------------------------------------------------------------------------------


def test_gspo_uses_one_geometric_mean_ratio_per_sequence_over_masked_tokens() -> None:
    # sample 0: token log-ratios +0.5, -0.5 (mean 0) and a masked tool token at +9:
    # token-level PPO would clip both tokens, GSPO sees ratio exactly 1 and clips nothing.
    # sample 1: log-ratios 0.3, 0.3 -> ratio e^0.3 = 1.35 > 1.28 -> clipped for A > 0.
    new = [torch.tensor([0.5, -0.5, 9.0], dtype=torch.float64), torch.tensor([0.3, 0.3], dtype=torch.float64)]
    old = [torch.zeros(3, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)]
    adv = [torch.full((3,), 2.0, dtype=torch.float64), torch.ones(2, dtype=torch.float64)]
    masks = [torch.tensor([1.0, 1.0, 0.0]), torch.ones(2)]
    new = [t.requires_grad_() for t in new]
    loss, clip, kl = gspo_policy_loss(new, old, adv, masks, LOW, HIGH)
    assert loss[0].tolist() == pytest.approx([-2.0, -2.0, -2.0])
    assert clip[0].tolist() == [0, 0, 0]
    assert loss[1].tolist() == pytest.approx([-1.28, -1.28]) and clip[1].tolist() == [1, 1]
    assert kl[1].tolist() == pytest.approx([-0.3, -0.3])
    # gradient of sample 0's masked-mean loss: d/d lp_t of -A exp(mean) = -A * 1 * m_t / 2
    (loss[0] * masks[0]).sum().backward()
    assert new[0].grad.tolist() == pytest.approx([-2.0, -2.0, 0.0])


# ---------------------------------------------------------------------------------------------
# TIS, value loss, entropy
# ---------------------------------------------------------------------------------------------


def test_tis_weights_clip_both_sides_without_gradient() -> None:
    train = torch.log(torch.tensor([0.05, 0.5, 1.0, 2.0, 3.0])).requires_grad_()
    roll = torch.zeros(5)
    w, ratio, clip = tis_weights(train, roll, 0.1, 2.0)
    assert ratio.tolist() == pytest.approx([0.05, 0.5, 1.0, 2.0, 3.0], rel=1e-6)
    assert w.tolist() == pytest.approx([0.1, 0.5, 1.0, 2.0, 2.0], rel=1e-6)
    assert clip.tolist() == [1, 0, 0, 0, 1]
    assert not w.requires_grad


def test_value_loss_hand_derived() -> None:
    v = torch.tensor([0.5, 0.1, 0.5, -0.6])
    old = torch.zeros(4)
    ret = torch.tensor([1.0, 1.0, 0.0, 1.0])
    loss, clip = value_loss(v, old, ret, 0.2)
    # 1: clipped 0.2 -> 0.64 vs 0.25 -> 0.64. 2: inside -> 0.81. 3: 0.04 vs 0.25 -> 0.25. 4: -0.2 -> 1.44 vs 2.56
    assert loss.tolist() == pytest.approx([0.64, 0.81, 0.25, 2.56])
    assert clip.tolist() == [1, 0, 1, 1]


def test_entropy_from_logits() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [2.0, -1.0, 0.5, 0.0], [100.0, 0.0, 0.0, 0.0]])
    ent = entropy_from_logits(logits)
    p = np.exp(logits[1].double().numpy())
    p /= p.sum()
    assert ent[0].item() == pytest.approx(math.log(4), rel=1e-6)
    assert ent[1].item() == pytest.approx(float(-(p * np.log(p)).sum()), rel=1e-5)
    assert ent[2].item() == pytest.approx(0.0, abs=1e-6) and torch.isfinite(ent).all()


# ---------------------------------------------------------------------------------------------
# Reductions and the data-parallel denominator
# ---------------------------------------------------------------------------------------------

VALS = [[1.0, 2.0, 30.0], [4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 10.0]]
MSKS = [[1, 1, 0], [1], [1, 0, 1, 1], [0, 0]]  # a tool token, a fully masked sample


def _t(xs):
    return [torch.tensor(x, dtype=torch.float32) for x in xs]


def _ref_reduce(vals, masks, mode):
    if mode == "per_token":
        num = sum(v * m for vs, ms in zip(vals, masks) for v, m in zip(vs, ms))
        return num / sum(sum(m) for m in masks)
    total = 0.0
    for vs, ms in zip(vals, masks):
        total += sum(v * m for v, m in zip(vs, ms)) / max(sum(ms), 1)
    return total / len(vals)


@pytest.mark.parametrize("mode", ["per_sample_mean", "per_token"])
def test_reduce_masked_matches_loop(mode: str) -> None:
    got = reduce_masked(_t(VALS), _t(MSKS), mode)
    assert got.item() == pytest.approx(_ref_reduce(VALS, MSKS, mode))
    # hand-derived: per-sample (1.5 + 4 + 20/3 + 0) / 4; per-token (1+2+4+5+7+8) / 6
    want = (1.5 + 4 + 20 / 3) / 4 if mode == "per_sample_mean" else 27 / 6
    assert got.item() == pytest.approx(want)
    # values under the mask never matter
    poked = [[v + 1000.0 * (1 - m) for v, m in zip(vs, ms)] for vs, ms in zip(VALS, MSKS)]
    assert reduce_masked(_t(poked), _t(MSKS), mode).item() == pytest.approx(got.item())


@pytest.mark.parametrize("mode", ["per_sample_mean", "per_token"])
def test_micro_batch_shares_sum_to_the_global_mean(mode: str) -> None:
    # 2 DP ranks x 2 micro-batches of unequal size; every micro-batch gets the global denominator.
    splits = [[0], [1, 2], [3], []]
    whole = _ref_reduce(VALS, MSKS, mode)
    denom = sum(local_denominator(_t([MSKS[i] for i in s]), mode) for s in splits)  # = all_reduce SUM
    shares = [reduce_masked(_t([VALS[i] for i in s]), _t([MSKS[i] for i in s]), mode, denom) for s in splits]
    assert sum(float(x) for x in shares) == pytest.approx(whole)
    # averaging micro-batch-local means instead gives another number here: the denominator matters
    local_means = [reduce_masked(_t([VALS[i] for i in s]), _t([MSKS[i] for i in s]), mode) for s in splits if s]
    assert sum(float(x) for x in local_means) / len(local_means) != pytest.approx(whole)


# ---------------------------------------------------------------------------------------------
# compute_rl_loss against a float64 loop reference
# ---------------------------------------------------------------------------------------------


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    lens = [3, 5, 1, 4]
    masks = [torch.tensor(m, dtype=torch.float32) for m in ([1, 1, 1], [1, 0, 0, 1, 1], [1], [1, 1, 1, 0])]
    lp = [(-torch.rand(n, generator=g) * 2) for n in lens]
    old = [x + 0.4 * (torch.rand(n, generator=g) - 0.5) for x, n in zip(lp, lens)]
    roll = [x + 0.8 * (torch.rand(n, generator=g) - 0.5) for x, n in zip(old, lens)]
    ref = [x + 0.6 * (torch.rand(n, generator=g) - 0.5) for x, n in zip(lp, lens)]
    adv = [torch.randn(n, generator=g) for n in lens]
    ent = [torch.rand(n, generator=g) * 3 for n in lens]
    return dict(log_probs=lp, old_log_probs=old, rollout_log_probs=roll, ref_log_probs=ref, advantages=adv,
                entropy=ent, loss_masks=masks)


def _ref_rl_loss(b, cfg: PolicyLossConfig, denom_samples: int, denom_tokens: float):
    """Token loops in float64 with math.*; independent of the torch implementation."""
    per_sample_sums = {k: [] for k in ("pg", "clip", "ent", "kl", "tis")}
    counts = []
    for i in range(len(b["log_probs"])):
        keys = ("log_probs", "old_log_probs", "rollout_log_probs", "ref_log_probs")
        lp, old, roll, ref = (b[k][i].double().tolist() for k in keys)
        adv, ent, m = b["advantages"][i].tolist(), b["entropy"][i].tolist(), b["loss_masks"][i].tolist()
        sums = dict.fromkeys(per_sample_sums, 0.0)
        for t in range(len(lp)):
            if not m[t]:
                continue
            r = math.exp(lp[t] - old[t])
            rc = min(max(r, 1 - cfg.eps_clip), 1 + cfg.clip_high)
            pg = max(-r * adv[t], -rc * adv[t])
            if cfg.eps_clip_c is not None and adv[t] < 0:
                pg = min(pg, -cfg.eps_clip_c * adv[t])
            w = math.exp(old[t] - roll[t])
            sums["tis"] += w
            if cfg.use_tis:
                pg *= min(max(w, cfg.tis_clip_low), cfg.tis_clip_high)
            sums["pg"] += pg
            sums["clip"] += float(-rc * adv[t] > -r * adv[t])
            sums["ent"] += ent[t]
            d = ref[t] - lp[t]
            sums["kl"] += math.exp(d) - 1 - d  # k3
        for k in sums:
            per_sample_sums[k].append(sums[k])
        counts.append(sum(m))
    if cfg.loss_reduction == "per_token":
        red = {k: sum(v) / denom_tokens for k, v in per_sample_sums.items()}
    else:
        red = {k: sum(s / max(c, 1) for s, c in zip(v, counts)) / denom_samples for k, v in per_sample_sums.items()}
    loss = red["pg"] - cfg.entropy_coef * red["ent"] + cfg.kl_loss_coef * red["kl"]
    return loss, red


@pytest.mark.parametrize("reduction", ["per_sample_mean", "per_token"])
@pytest.mark.parametrize("use_tis", [False, True])
def test_compute_rl_loss_matches_reference(reduction: str, use_tis: bool) -> None:
    b = _batch(0)
    cfg = PolicyLossConfig(eps_clip=0.1, eps_clip_high=0.15, eps_clip_c=3.0, use_tis=use_tis, tis_clip_low=0.9,
                           tis_clip_high=1.1, kl_loss_coef=0.3, kl_loss_type="k3", entropy_coef=0.01,
                           loss_reduction=reduction)
    # a global batch twice this micro-batch: 8 samples / this batch's tokens + 7 more
    denom = 8.0 if reduction == "per_sample_mean" else float(sum(m.sum() for m in b["loss_masks"])) + 7.0
    loss, metrics = compute_rl_loss(cfg, global_denominator=denom, **b)
    want, red = _ref_rl_loss(b, cfg, 8, denom)
    assert loss.item() == pytest.approx(want, rel=1e-5)
    assert metrics["loss"].item() == pytest.approx(want, rel=1e-5)
    assert metrics["pg_clipfrac"].item() == pytest.approx(red["clip"], rel=1e-5)
    assert metrics["entropy"].item() == pytest.approx(red["ent"], rel=1e-5)
    assert metrics["kl"].item() == pytest.approx(red["kl"], rel=1e-5)
    assert 0 < red["clip"]  # the batch exercises clipping, or the comparison would be weak
    assert ("tis" in metrics) == use_tis
    if use_tis:
        assert metrics["tis"].item() == pytest.approx(red["tis"], rel=1e-5)
        assert 0 < metrics["tis_clipfrac"].item()
    assert "train_rollout_logprob_abs_diff" in metrics
    assert all(not v.requires_grad for v in metrics.values())


def test_compute_rl_loss_gradient_matches_reference_autograd() -> None:
    b = _batch(1)
    cfg = PolicyLossConfig(eps_clip=0.1, kl_loss_coef=0.2, kl_loss_type="low_var_kl", loss_reduction="per_token")
    lp = [x.clone().requires_grad_() for x in b["log_probs"]]
    b.pop("entropy")
    loss, _ = compute_rl_loss(cfg, global_denominator=None, **{**b, "log_probs": lp})
    loss.backward()
    # reference: token-by-token float64 autograd on scalars
    lp64 = [x.detach().double().requires_grad_() for x in b["log_probs"]]
    total, n = 0.0, 0.0
    for i, x in enumerate(lp64):
        for t in range(x.numel()):
            if not b["loss_masks"][i][t]:
                continue
            a = float(b["advantages"][i][t])
            r = torch.exp(x[t] - float(b["old_log_probs"][i][t]))
            surr = torch.maximum(-r * a, -torch.clamp(r, 0.9, 1.1) * a)
            d = float(b["ref_log_probs"][i][t]) - x[t]
            total = total + surr + 0.2 * (torch.exp(d) - 1 - d)
            n += 1
    (total / n).backward()
    for g, want in zip(lp, lp64):
        np.testing.assert_allclose(g.grad.numpy(), want.grad.numpy(), rtol=1e-4, atol=1e-6)
    # masked tokens get no gradient at all
    assert lp[1].grad[1].item() == 0.0 and lp[3].grad[3].item() == 0.0


def test_gspo_estimator_in_compute_rl_loss_uses_sequence_ratio() -> None:
    b = _batch(2)
    b.pop("entropy")
    cfg = PolicyLossConfig(eps_clip=3e-4, eps_clip_high=4e-4, estimator="gspo")
    _, m_gspo = compute_rl_loss(cfg, global_denominator=None, **b)
    for i in range(4):
        lp, old, msk = b["log_probs"][i], b["old_log_probs"][i], b["loss_masks"][i]
        seq = float(((old - lp) * msk).sum() / msk.sum())
        assert abs(seq) > 4e-4  # every sequence is outside the tiny GSPO trust region
    assert m_gspo["pg_clipfrac"].item() > 0
    # ppo_kl is the per-sequence masked mean, so its per-sample mean equals the mean of those
    seq_kls = [
        float(((b["old_log_probs"][i] - b["log_probs"][i]) * b["loss_masks"][i]).sum() / b["loss_masks"][i].sum())
        for i in range(4)
    ]
    want = sum(seq_kls) / 4
    assert m_gspo["ppo_kl"].item() == pytest.approx(want, rel=1e-5)


def _cispo_reference(b, eps_lo: float, eps_hi: float, kl_coef: float, unbiased: bool):
    """Per-token float64 scalars with torch autograd on each token alone: CISPO's loss is
    -w * A * log p with w = clamp(exp(log p - old)) a constant, plus the (ratio-weighted) k3 KL;
    per-sample means, then the mean over samples."""
    lp64 = [x.detach().double().requires_grad_() for x in b["log_probs"]]
    total, clipped = 0.0, 0.0
    for i, x in enumerate(lp64):
        m = b["loss_masks"][i].tolist()
        s, c = 0.0, 0.0
        for t in range(x.numel()):
            if not m[t]:
                continue
            a, old, ref = (float(b[k][i][t]) for k in ("advantages", "old_log_probs", "ref_log_probs"))
            r = math.exp(x[t].item() - old)
            w = min(max(r, 1.0 - eps_lo), 1.0 + eps_hi)
            c += float(w != r)
            d = ref - x[t]
            k3 = torch.exp(d) - 1 - d
            if unbiased:
                k3 = torch.exp(x[t] - old) * k3
            s = s - w * a * x[t] + kl_coef * k3
        total = total + s / max(sum(m), 1)
        clipped += c / max(sum(m), 1)
    n = len(lp64)
    (total / n).backward()
    return total.item() / n, clipped / n, [x.grad for x in lp64]


@pytest.mark.parametrize("unbiased", [False, True])
def test_cispo_loss_and_gradient_match_reference(unbiased: bool) -> None:
    b = _batch(4)
    b.pop("entropy")
    cfg = PolicyLossConfig(eps_clip=0.05, eps_clip_high=0.1, estimator="cispo", kl_loss_coef=0.3, kl_loss_type="k3",
                           use_unbiased_kl=unbiased)
    lp = [x.clone().requires_grad_() for x in b["log_probs"]]
    loss, m = compute_rl_loss(cfg, global_denominator=None, **{**b, "log_probs": lp})
    loss.backward()
    want, clipfrac, grads = _cispo_reference(b, 0.05, 0.1, 0.3, unbiased)
    assert loss.item() == pytest.approx(want, rel=1e-5)
    assert m["pg_clipfrac"].item() == pytest.approx(clipfrac, rel=1e-6) and 0 < clipfrac < 1
    for g, w in zip(lp, grads):
        np.testing.assert_allclose(g.grad.numpy(), w.numpy(), rtol=1e-4, atol=1e-6)
    # unlike PPO's clipped branch, a clipped CISPO token still has a gradient: -w * A / count
    i, t = next((i, t) for i in range(4) for t in range(lp[i].numel())
                if b["loss_masks"][i][t]
                and not 0.95 <= math.exp(float(b["log_probs"][i][t] - b["old_log_probs"][i][t])) <= 1.1)
    assert lp[i].grad[t].item() != 0.0


def test_unbiased_kl_weights_by_the_new_old_ratio_before_the_clamp() -> None:
    logp, ref, old = torch.tensor([-1.0, -30.0]), torch.tensor([-1.5, -1.0]), torch.tensor([-1.2, -29.0])
    w = torch.exp(logp - old)
    for kind in KL_KINDS_UNDER_TEST:
        plain = kl_estimate(logp, ref, kind, clamp=1e30)  # unclamped
        got = kl_estimate(logp, ref, kind, importance_ratio=w)
        want = [math.exp(a - o) * float(p) for a, o, p in zip(logp.tolist(), old.tolist(), plain.tolist())]
        if kind == "low_var_kl":
            want = [min(max(x, -10.0), 10.0) for x in want]
        np.testing.assert_allclose(got.tolist(), want, rtol=1e-6)
    # on the first step on a batch (old = new) it is the plain estimate
    assert torch.equal(kl_estimate(logp, ref, "k3", importance_ratio=torch.ones(2)), kl_estimate(logp, ref, "k3"))


KL_KINDS_UNDER_TEST = ("k1", "k2", "k3", "low_var_kl")


def test_kl_to_reference_is_reported_without_entering_the_loss_when_coef_is_zero() -> None:
    b = _batch(3)
    b.pop("entropy")
    cfg = PolicyLossConfig(kl_loss_type="k2")
    loss_with_ref, m = compute_rl_loss(cfg, global_denominator=None, **b)
    loss_without, m2 = compute_rl_loss(cfg, global_denominator=None, **{**b, "ref_log_probs": None})
    assert loss_with_ref.item() == loss_without.item() and "kl" not in m2
    want = np.mean([np.mean([(a - r) ** 2 / 2 for a, r, k in zip(lp.tolist(), ref.tolist(), msk.tolist()) if k])
                    for lp, ref, msk in zip(b["log_probs"], b["ref_log_probs"], b["loss_masks"])])
    assert m["kl"].item() == pytest.approx(want, rel=1e-5)


def test_first_step_on_fresh_data_is_plain_policy_gradient() -> None:
    # old_log_probs=None: ratio 1, no clipping, loss = -mean(A), gradient -A per token.
    lp = [torch.tensor([-1.0, -2.0], requires_grad=True)]
    loss, metrics = compute_rl_loss(
        PolicyLossConfig(loss_reduction="per_token"), log_probs=lp, advantages=[torch.tensor([1.0, -3.0])],
        loss_masks=[torch.ones(2)], global_denominator=None,
    )
    loss.backward()
    assert loss.item() == pytest.approx(1.0) and metrics["pg_clipfrac"].item() == 0.0
    assert lp[0].grad.tolist() == pytest.approx([-0.5, 1.5])


def test_compute_value_loss() -> None:
    loss, m = compute_value_loss(
        values=[torch.tensor([0.5, 0.1]), torch.tensor([0.5, 9.0])], old_values=[torch.zeros(2), torch.zeros(2)],
        returns=[torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.0])],
        loss_masks=[torch.ones(2), torch.tensor([1.0, 0.0])],
        value_clip=0.2, loss_reduction="per_sample_mean", global_denominator=2,
    )
    assert loss.item() == pytest.approx(((0.64 + 0.81) / 2 + 0.25) / 2)
    assert m["value_clipfrac"].item() == pytest.approx((0.5 + 1.0) / 2)


# ---------------------------------------------------------------------------------------------
# configuration and input errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"eps_clip": 0.0}, "--eps-clip "),
        ({"eps_clip": 1.5}, "--eps-clip "),
        ({"eps_clip_high": -0.1}, "--eps-clip-high"),
        ({"eps_clip_c": 1.0}, "--eps-clip-c"),
        ({"tis_clip_low": -0.5}, "--tis-clip-low"),
        ({"kl_loss_coef": -1.0}, "--kl-loss-coef"),
        ({"kl_loss_type": "k4"}, "--kl-loss-type"),
        ({"entropy_coef": -0.1}, "--entropy-coef"),
        ({"loss_reduction": "mean"}, "--calculate-per-token-loss"),
    ],
)
def test_bad_loss_config_names_the_flag(kwargs: dict, flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        PolicyLossConfig(**kwargs)


def test_eps_clip_high_defaults_to_eps_clip() -> None:
    assert PolicyLossConfig(eps_clip=0.25).clip_high == 0.25
    assert PolicyLossConfig(eps_clip=0.2, eps_clip_high=0.28).clip_high == 0.28


def test_missing_inputs_are_named() -> None:
    base = dict(log_probs=[torch.zeros(2)], advantages=[torch.ones(2)], loss_masks=[torch.ones(2)],
                global_denominator=None)
    with pytest.raises(ValueError, match="rollout_log_probs"):
        compute_rl_loss(PolicyLossConfig(use_tis=True), **base)
    with pytest.raises(ValueError, match="ref_log_probs"):
        compute_rl_loss(PolicyLossConfig(kl_loss_coef=0.1), **base)
    with pytest.raises(ValueError, match="entropy"):
        compute_rl_loss(PolicyLossConfig(entropy_coef=0.1), **base)
    with pytest.raises(ValueError, match=r"advantages\[0\] has shape \(3,\)"):
        compute_rl_loss(PolicyLossConfig(), **{**base, "advantages": [torch.ones(3)]})
    with pytest.raises(ConfigError, match="--value-clip"):
        value_loss(torch.zeros(1), torch.zeros(1), torch.zeros(1), 0.0)


# ---------------------------------------------------------------------------------------------
# --loss-type: sft_loss and custom_loss (rlslurm/trainer/actor_loss.py)
# ---------------------------------------------------------------------------------------------


def _inputs(b, cfg: PolicyLossConfig, denom, log_probs=None) -> LossInputs:
    return LossInputs(cfg=cfg, log_probs=log_probs or b["log_probs"], entropy=b["entropy"], loss_masks=b["loss_masks"],
                      advantages=b["advantages"], returns=b["advantages"], old_log_probs=b["old_log_probs"],
                      ref_log_probs=b["ref_log_probs"], rollout_log_probs=b["rollout_log_probs"],
                      global_denominator=denom)


@pytest.mark.parametrize("reduction", ["per_sample_mean", "per_token"])
def test_sft_loss_is_the_masked_negative_log_likelihood(reduction: str) -> None:
    b = _batch(5)
    cfg = PolicyLossConfig(loss_type="sft_loss", loss_reduction=reduction)
    lp = [x.clone().requires_grad_() for x in b["log_probs"]]
    denom = 8.0 if reduction == "per_sample_mean" else float(sum(m.sum() for m in b["loss_masks"])) + 5.0
    loss, metrics = loss_function(cfg)(_inputs(b, cfg, denom, lp))
    loss.backward()
    # float64 reference: per token -log p, no advantage anywhere; the global denominator as in RL
    per_sample = [[-v for v, k in zip(x.double().tolist(), m.tolist()) if k]
                  for x, m in zip(b["log_probs"], b["loss_masks"])]
    if reduction == "per_token":
        want = sum(sum(s) for s in per_sample) / denom
        grads = [[-1.0 / denom * k for k in m.tolist()] for m in b["loss_masks"]]
    else:
        want = sum(sum(s) / max(len(s), 1) for s in per_sample) / denom
        grads = [[-k / max(m.sum().item(), 1) / denom for k in m.tolist()] for m in b["loss_masks"]]
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert list(metrics) == ["loss"] and metrics["loss"].item() == loss.item()
    for g, w in zip(lp, grads):
        np.testing.assert_allclose(g.grad.numpy(), w, rtol=1e-6)
    assert metric_keys(cfg, have_ref=True, have_rollout_logprobs=True) == ["loss"]


def test_policy_loss_type_is_compute_rl_loss() -> None:
    b = _batch(6)
    cfg = PolicyLossConfig(kl_loss_coef=0.1, entropy_coef=0.01)
    got, m = loss_function(cfg)(_inputs(b, cfg, 8.0))
    want, m2 = compute_rl_loss(cfg, global_denominator=8.0, **b)
    assert got.item() == want.item() and m.keys() == m2.keys()
    assert metric_keys(cfg, have_ref=True, have_rollout_logprobs=True) == [
        "loss", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "kl", "train_rollout_logprob_abs_diff"]


def test_custom_loss_function_is_loaded_from_a_file_and_called_per_micro_batch(tmp_path) -> None:
    plugin = tmp_path / "my_loss.py"
    plugin.write_text(
        "def weighted_nll(inputs):\n"
        "    loss = inputs.reduce([-a * lp for a, lp in zip(inputs.advantages, inputs.log_probs)])\n"
        "    return loss, {'loss': loss.detach(), 'adv': inputs.reduce(inputs.advantages)}\n"
        "weighted_nll.metric_keys = ('adv',)\n"
    )
    b = _batch(7)
    cfg = PolicyLossConfig(loss_type="custom_loss", custom_loss_function_path=f"{plugin}:weighted_nll",
                           loss_reduction="per_token")
    loss, metrics = loss_function(cfg)(_inputs(b, cfg, None))
    num = sum(-a * lp * k for x, y, m in zip(b["advantages"], b["log_probs"], b["loss_masks"])
              for a, lp, k in zip(x.double().tolist(), y.double().tolist(), m.tolist()))
    assert loss.item() == pytest.approx(num / sum(m.sum().item() for m in b["loss_masks"]), rel=1e-5)
    assert metric_keys(cfg, have_ref=False, have_rollout_logprobs=True) == ["loss", "adv"]


def test_unknown_loss_type_names_the_flag() -> None:
    with pytest.raises(ConfigError, match="--loss-type must be one of policy_loss, sft_loss, custom_loss"):
        PolicyLossConfig(loss_type="dpo_loss")


# ---------------------------------------------------------------------------------------------
# --custom-tis-function-path
# ---------------------------------------------------------------------------------------------

_TIS = '''
import torch

def clamped(inputs):
    return torch.exp(inputs.old_log_probs - inputs.rollout_log_probs).clamp(inputs.low, inputs.high)

def icepop(inputs):
    r = torch.exp(inputs.old_log_probs - inputs.rollout_log_probs)
    return torch.where((r >= inputs.low) & (r <= inputs.high), r, torch.zeros_like(r))

def short(inputs):
    return inputs.loss_mask[:1]

def negative(inputs):
    return -torch.ones_like(inputs.loss_mask)
'''


def test_custom_tis_function_replaces_the_weights(tmp_path) -> None:
    """A plugin with the built-in rule trains exactly as --use-tis; an icepop rule (weight 0 outside
    the bounds) drops those tokens' policy loss; bad answers are one line naming the flag."""
    (tmp_path / "tis.py").write_text(_TIS)
    b = _batch(0)
    base = dict(eps_clip=0.1, use_tis=True, tis_clip_low=0.9, tis_clip_high=1.1, loss_reduction="per_token")
    builtin, m_builtin = compute_rl_loss(PolicyLossConfig(**base), global_denominator=None, **b)
    same, m_same = compute_rl_loss(PolicyLossConfig(**base, custom_tis_function_path=f"{tmp_path / 'tis.py'}:clamped"),
                                   global_denominator=None, **b)
    assert same.item() == builtin.item() and m_same["tis_clipfrac"].item() == m_builtin["tis_clipfrac"].item()

    ice, m_ice = compute_rl_loss(PolicyLossConfig(**base, custom_tis_function_path=f"{tmp_path / 'tis.py'}:icepop"),
                                 global_denominator=None, **b)
    # reference: the per-token PPO loss times the icepop weight, token mean over the masks
    pg = compute_rl_loss(PolicyLossConfig(eps_clip=0.1, loss_reduction="per_token"), global_denominator=None,
                         **{**b, "entropy": None})[1]["pg_loss"]
    assert m_ice["tis_clipfrac"].item() == m_builtin["tis_clipfrac"].item() > 0
    total = n = 0.0
    for lp, old, roll, a, m in zip(b["log_probs"], b["old_log_probs"], b["rollout_log_probs"], b["advantages"],
                                   b["loss_masks"]):
        r_new, r_tis = torch.exp(lp - old), torch.exp(old - roll)
        surr = torch.maximum(-r_new * a, -r_new.clamp(0.9, 1.1) * a)
        w = torch.where((r_tis >= 0.9) & (r_tis <= 1.1), r_tis, torch.zeros_like(r_tis))
        total += float((surr * w * m).sum())
        n += float(m.sum())
    assert m_ice["pg_loss"].item() == pytest.approx(total / n, rel=1e-5) and m_ice["pg_loss"].item() != pg.item()
    for fn, why in (("short", "must return a tensor of shape"), ("negative", "finite and >= 0")):
        with pytest.raises(ConfigError, match=why) as e:
            compute_rl_loss(PolicyLossConfig(**base, custom_tis_function_path=f"{tmp_path / 'tis.py'}:{fn}"),
                            global_denominator=None, **b)
        assert "--custom-tis-function-path" in str(e.value) and "\n" not in str(e.value)
