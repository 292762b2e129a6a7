"""Advantage estimators: GRPO (and Dr.GRPO), GSPO, CISPO, REINFORCE++ (+baseline), PPO with GAE.

Semantics follow slime (``slime/ray/rollout.py::_post_process_rewards`` for the group
normalisation, ``slime/utils/ppo_utils.py`` and ``backends/megatron_utils/loss.py`` for the
rest); the code is our own. Differences from slime, on purpose:

- the group normalisation happens here (slime does it in the rollout driver), from
  ``group_index``, so groups may be of unequal size and samples in any order;
- the sequence reward sits on the last *loss-masked* token for PPO too (slime: the last
  token), and KL shaping ignores masked tokens for every estimator: tool output was not
  sampled by the policy, so neither a reward nor a KL penalty belongs to it;
- advantages are zero on masked tokens, so a consumer that forgets the mask still cannot
  train on tool tokens;
- ``--kl-coef`` with grpo/gspo is an error (slime silently ignores it there).

``--custom-advantage-function-path module.path:fn`` (or ``file.py:fn``) replaces the
estimator's per-token advantages: ``fn(inputs) -> (advantages, returns)``, ``inputs`` an
``AdvantageInputs``, both results lists of 1-D tensors shaped like ``inputs.loss_masks``. It is
called once per rollout on each data-parallel rank with that rank's samples (every sample of a
prompt group is on the ranks' union, not necessarily on one: a group statistic must come from
``rewards``, which already carry the estimator's group baseline). --normalize-advantages and the
zeroing of masked tokens apply to what it returns; ``returns`` are the critic's targets (PPO).

Every per-sample tensor is 1-D over that sample's response tokens; math is fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from rlslurm.errors import ConfigError, DataError
from rlslurm.plugins import cached_callable
from rlslurm.settings.rl_settings import ESTIMATOR_NAMES, RLKnobs, check_rl_settings, estimator
from rlslurm.trainer.losses import KL_KINDS, PolicyLossConfig, check_same_lengths, kl_estimate

# The names and what each estimator needs and does live in one registry (rlslurm/settings/rl_settings.py).
ESTIMATORS: tuple[str, ...] = ESTIMATOR_NAMES

GROUP_STD_EPS = 1e-6
WHITEN_EPS = 1e-8


@dataclass(frozen=True)
class AdvantageConfig:
    """How rewards become per-token advantages.

    ``grpo_std_normalization=False`` is Dr.GRPO (centre on the group mean, no division by
    the group std). ``rewards_normalization=False`` turns the group baseline off entirely.
    ``kl_coef`` shapes the per-token reward with -kl_coef * KL(pi || ref) estimated by
    ``kl_estimator`` (PPO, REINFORCE++ only). ``normalize_advantages`` whitens advantages
    over all loss-masked tokens of the batch (required by REINFORCE++ as in slime).
    ``num_critic_only_steps`` (PPO): the first rollouts train only the critic.
    """

    estimator: str = "grpo"   # a name of rlslurm/settings/rl_settings.ESTIMATORS
    rewards_normalization: bool = True
    grpo_std_normalization: bool = True
    kl_coef: float = 0.0
    kl_estimator: str = "k1"
    gamma: float = 1.0
    lam: float = 1.0
    normalize_advantages: bool = False
    num_critic_only_steps: int = 0
    custom_advantage_function_path: str | None = None
    custom_reward_post_process_path: str | None = None

    def __post_init__(self) -> None:
        # Rules across settings (--kl-coef vs the estimator, REINFORCE++ vs --normalize-advantages,
        # --num-critic-only-steps vs PPO, ...) are rlslurm/settings/rl_settings.check_rl_settings's.
        estimator(self.estimator)
        if self.kl_coef < 0.0:
            raise ConfigError(f"--kl-coef must be >= 0, got {self.kl_coef}")
        if self.kl_estimator not in KL_KINDS:
            raise ConfigError(f"--kl-loss-type must be one of {KL_KINDS}, got {self.kl_estimator!r}")
        if not 0.0 <= self.gamma <= 1.0:
            raise ConfigError(f"--gamma must be in [0, 1], got {self.gamma}")
        if not 0.0 <= self.lam <= 1.0:
            raise ConfigError(f"--lambd must be in [0, 1], got {self.lam}")
        if self.num_critic_only_steps < 0:
            raise ConfigError(f"--num-critic-only-steps must be >= 0, got {self.num_critic_only_steps}")


def check_rl_configs(adv: AdvantageConfig, loss: PolicyLossConfig) -> None:
    """The two configs were built from the same settings (the user-facing rules across settings are
    rlslurm/settings/rl_settings.check_rl_settings's)."""
    if estimator(adv.estimator).policy_gradient != estimator(loss.estimator).policy_gradient:
        raise ConfigError(
            f"the policy loss was built for estimator {loss.estimator!r} but --advantage-estimator is "
            f"{adv.estimator!r}; their policy-gradient terms differ"
        )


class TrainKnobs(RLKnobs, Protocol):
    """The RL fields of ``rlslurm.settings.config.TrainSection`` that the two configs are built from: those the
    cross-field rules read (``rl_settings.RLKnobs``) and these."""

    kl_loss_type: str
    entropy_coef: float
    calculate_per_token_loss: bool
    gamma: float
    lambd: float
    custom_reward_post_process_path: str | None


def rl_configs_from_train(train: TrainKnobs) -> tuple[AdvantageConfig, PolicyLossConfig]:
    """Both configs from the run config's train section (``rlslurm.settings.config.TrainSection``).

    Maps slime's flag semantics in one place: ``--use-kl-loss`` gates ``--kl-loss-coef``,
    ``--calculate-per-token-loss`` picks the reduction, ``--tis-clip`` is the upper TIS bound,
    and the KL of ``--kl-coef`` reward shaping uses ``--kl-loss-type`` as slime does.
    Typed by a Protocol so this module does not import the CLI's config.
    """
    t = train
    check_rl_settings(t)  # the same rules resolve() checked at submit
    adv = AdvantageConfig(
        estimator=t.advantage_estimator,
        rewards_normalization=t.rewards_normalization,
        grpo_std_normalization=t.grpo_std_normalization,
        kl_coef=t.kl_coef,
        kl_estimator=t.kl_loss_type,
        gamma=t.gamma,
        lam=t.lambd,
        normalize_advantages=t.normalize_advantages,
        num_critic_only_steps=t.num_critic_only_steps,
        custom_advantage_function_path=t.custom_advantage_function_path,
        custom_reward_post_process_path=t.custom_reward_post_process_path,
    )
    loss = PolicyLossConfig(
        eps_clip=t.eps_clip,
        eps_clip_high=t.eps_clip_high,
        eps_clip_c=t.eps_clip_c,
        use_tis=t.use_tis,
        custom_tis_function_path=t.custom_tis_function_path,
        tis_clip_low=t.tis_clip_low,
        tis_clip_high=t.tis_clip,
        kl_loss_coef=t.kl_loss_coef if t.use_kl_loss else 0.0,
        kl_loss_type=t.kl_loss_type,  # type: ignore[arg-type]  # validated in __post_init__
        use_unbiased_kl=t.use_unbiased_kl,
        entropy_coef=t.entropy_coef,
        loss_reduction="per_token" if t.calculate_per_token_loss else "per_sample_mean",
        estimator=t.advantage_estimator,
        loss_type=t.loss_type,
        custom_loss_function_path=t.custom_loss_function_path,
    )
    check_rl_configs(adv, loss)
    return adv, loss


@dataclass(frozen=True)
class AdvantageInputs:
    """What --custom-advantage-function-path's function gets, per sample over its response tokens.

    ``rewards`` [n]: the scalar rewards after the estimator's group baseline (raw with
    --disable-rewards-normalization or an estimator without one). ``kl``: the per-token KL to
    the reference of --kl-coef shaping (--kl-loss-type, zero on masked tokens; all zeros when
    --kl-coef is 0). ``log_probs``: the old policy's (no gradient), ``ref_log_probs`` the
    reference model's when a KL setting loads it, ``values`` the critic's (PPO).
    """

    cfg: AdvantageConfig
    rewards: Tensor
    group_index: Tensor
    loss_masks: list[Tensor]
    kl: list[Tensor]
    log_probs: list[Tensor] | None
    ref_log_probs: list[Tensor] | None
    values: list[Tensor] | None


AdvantageFn = Callable[[AdvantageInputs], tuple[list[Tensor], list[Tensor]]]


def _custom_advantages(cfg: AdvantageConfig, inputs: AdvantageInputs) -> tuple[list[Tensor], list[Tensor]]:
    spec = cfg.custom_advantage_function_path
    assert spec
    fn: AdvantageFn = cached_callable(spec, what="--custom-advantage-function-path", min_args=1)
    out = fn(inputs)
    n = len(inputs.loss_masks)
    if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(x, (list, tuple)) for x in out)):
        raise ConfigError(f"--custom-advantage-function-path {spec}: must return (advantages, returns), two lists "
                          f"of {n} per-token tensors; got {type(out).__name__}")
    for name, xs in zip(("advantages", "returns"), out):
        if not all(isinstance(x, Tensor) for x in xs):
            raise ConfigError(f"--custom-advantage-function-path {spec}: {name} must be torch tensors")
        try:
            check_same_lengths(inputs.loss_masks, **{name: list(xs)})
        except ValueError as e:
            raise ConfigError(f"--custom-advantage-function-path {spec}: returned {e}") from None
        bad = next((i for i, x in enumerate(xs) if not bool(torch.isfinite(x).all())), None)
        if bad is not None:
            raise ConfigError(f"--custom-advantage-function-path {spec}: {name}[{bad}] is not finite")
    device = inputs.loss_masks[0].device
    return ([a.detach().float().to(device) for a in out[0]], [r.detach().float().to(device) for r in out[1]])


def actor_trains(cfg: AdvantageConfig, rollout_id: int) -> bool:
    """False during PPO's critic-only warm-up: the critic learns values before the actor uses them."""
    return not estimator(cfg.estimator).critic or rollout_id >= cfg.num_critic_only_steps


def reward_from(sample_reward: float | Mapping[str, object], key: str | None, where: str = "reward") -> float:
    """The scalar reward of one sample; ``key`` (``--reward-key``) picks it from a dict reward.

    ``where`` names the sample for errors (e.g. ``buffer/rollout_000003/samples.jsonl:17``).
    """
    if isinstance(sample_reward, Mapping):
        if key is None:
            raise DataError(
                where, f"reward is a dict with keys {sorted(sample_reward)}; choose one with --reward-key"
            )
        if key not in sample_reward:
            raise DataError(where, f"--reward-key {key!r} is not in the reward dict (keys: {sorted(sample_reward)})")
        value = sample_reward[key]
    else:
        value = sample_reward
    if isinstance(value, bool):
        value = float(value)
    if not isinstance(value, (int, float)):
        raise DataError(where, f"reward must be a number, got {type(value).__name__}: {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise DataError(where, f"reward is {value}; a non-finite reward would poison the whole batch")
    return value


# ---------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------


def group_normalize(rewards: Tensor, group_index: Tensor, divide_by_std: bool) -> Tensor:
    """reward - mean(group) [/ (std(group) + 1e-6)], groups given by ``group_index``.

    std is the unbiased (n-1) one as in slime. A group whose rewards are all equal gives 0
    (no signal, no NaN); a group of one sample gives 0 too.
    """
    rewards = rewards.float()
    _, inverse = torch.unique(group_index, return_inverse=True)
    n_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    count = torch.zeros(n_groups, device=rewards.device).index_add(0, inverse, torch.ones_like(rewards))
    total = torch.zeros(n_groups, device=rewards.device).index_add(0, inverse, rewards)
    centred = rewards - (total / count)[inverse]
    if not divide_by_std:
        return centred
    sq = torch.zeros(n_groups, device=rewards.device).index_add(0, inverse, centred.square())
    std = torch.sqrt(sq / (count - 1).clamp_min(1.0))
    return centred / (std[inverse] + GROUP_STD_EPS)


RewardPostProcessFn = Callable[[list[Any], Tensor], Any]


def post_processed_rewards(spec: str, samples: list[Any], rewards: Tensor) -> Tensor:
    """--custom-reward-post-process-path (slime's name; as there it takes the place of the group
    normalisation): `fn(samples, rewards)` gets the rollout's samples (rlslurm.buffer.Sample: tokens,
    status, metadata, group_index) and their raw scalar rewards [n], and returns the n rewards the
    advantages are computed from. Every trainer rank calls it on the whole rollout, so it must be
    deterministic. The metrics keep the raw rewards."""
    n = rewards.numel()
    fn: RewardPostProcessFn = cached_callable(spec, what="--custom-reward-post-process-path", min_args=2)
    out = fn(samples, rewards.clone())
    try:
        out = torch.as_tensor(out, dtype=torch.float32).reshape(-1)
    except (TypeError, ValueError, RuntimeError):
        raise ConfigError(f"--custom-reward-post-process-path {spec}: returned {type(out).__name__}; expected "
                          f"{n} numbers (a tensor or a list)") from None
    if out.numel() != n:
        raise ConfigError(f"--custom-reward-post-process-path {spec}: returned {out.numel()} rewards for {n} samples")
    bad = torch.nonzero(~torch.isfinite(out)).reshape(-1)
    if bad.numel():
        raise ConfigError(f"--custom-reward-post-process-path {spec}: reward {int(bad[0])} is "
                          f"{float(out[bad[0]])}; rewards must be finite")
    return out.to(rewards.device)


def group_baseline(cfg: AdvantageConfig, rewards: Tensor, group_index: Tensor) -> Tensor:
    """The scalar rewards after the estimator's group baseline: ``group_normalize``d (divided by
    the std for estimators with ``group_std`` unless Dr.GRPO), or unchanged for an estimator
    without a baseline or with --no-rewards-normalization. Every sample of a group must be given."""
    est = estimator(cfg.estimator)
    if not (cfg.rewards_normalization and est.group_baseline):
        return rewards
    return group_normalize(rewards, group_index, divide_by_std=cfg.grpo_std_normalization and est.group_std)


def last_masked_index(mask: Tensor) -> int:
    """Where the sequence reward lands: the last loss-masked token (last token if none is)."""
    idx = torch.nonzero(mask, as_tuple=False)
    return int(idx[-1].item()) if idx.numel() else mask.numel() - 1


def discounted_cumsum(x: Tensor, discount: float, chunk: int = 128) -> Tensor:
    """y_t = x_t + discount * y_{t+1} along the last dim of [B, T] (y past the end = 0).

    A plain reverse loop launches O(T) tiny kernels, slow on a GPU for 16k-token answers.
    Instead each chunk of C steps is solved by one [C, C] matmul with the discount powers,
    and only the chunk boundaries are chained: O(T / C) sequential steps.
    """
    b, t = x.shape
    if t == 0:
        return x.clone()
    n_chunks = -(-t // chunk)
    padded = torch.nn.functional.pad(x.float(), (0, n_chunks * chunk - t))  # zeros extend nothing
    steps = torch.arange(chunk, device=x.device, dtype=torch.float32)
    lag = steps[:, None] - steps[None, :]  # lag[k, j] = k - j: how far token k lies after j
    d = torch.tensor(discount, device=x.device, dtype=torch.float32)
    weights = torch.where(lag >= 0, d.pow(lag.clamp_min(0)), torch.zeros((), device=x.device))
    local = padded.view(b, n_chunks, chunk) @ weights  # sum within the chunk
    carry_decay = d.pow(chunk - steps)  # discount from position j to the next chunk's start
    out = torch.empty_like(local)
    carry = torch.zeros(b, device=x.device)
    for c in range(n_chunks - 1, -1, -1):
        out[:, c] = local[:, c] + carry[:, None] * carry_decay
        carry = out[:, c, 0]
    return out.reshape(b, -1)[:, :t]


def discounted_returns(token_rewards: list[Tensor], gamma: float) -> list[Tensor]:
    """G_t = r_t + gamma * G_{t+1}, per sample, G past the end = 0."""
    padded, lengths = _pad(token_rewards)
    g = discounted_cumsum(padded, gamma)
    return [g[i, :n] for i, n in enumerate(lengths)]


def gae(
    token_rewards: list[Tensor], values: list[Tensor], gamma: float, lam: float
) -> tuple[list[Tensor], list[Tensor]]:
    """Generalised advantage estimation per sample; every response ends the episode.

    delta_t = r_t + gamma * V_{t+1} - V_t (V past the end = 0; a truncated response is
    treated as terminal, as in slime), A_t = delta_t + gamma * lam * A_{t+1}, R_t = A_t + V_t.
    Samples are padded with zeros, which leaves the recurrence of shorter ones untouched.
    """
    r, lengths = _pad(token_rewards)
    v, _ = _pad(values)
    next_v = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], dim=1)
    adv = discounted_cumsum(r + gamma * next_v - v, gamma * lam)
    ret = adv + v
    return [adv[i, :n] for i, n in enumerate(lengths)], [ret[i, :n] for i, n in enumerate(lengths)]


def masked_whiten(
    values: list[Tensor], masks: list[Tensor], process_group: dist.ProcessGroup | None = None
) -> list[Tensor]:
    """(x - mean) / sqrt(var + 1e-8) with mean/var over all masked tokens of all samples.

    With ``process_group`` the statistics are all-reduced over it, so every data-parallel
    rank whitens with the global-batch mean/var (pass the DP group *with* context
    parallelism). var is unbiased (n-1). No masked token at all: returned unchanged.
    """
    x = torch.cat([t.float().reshape(-1) for t in values])
    m = torch.cat([t.float().reshape(-1) for t in masks]).to(x.device)
    # float64 sums: a million tokens of fp32 squares lose digits that the variance needs.
    stats = torch.stack([(x * m).sum(), (x.square() * m).sum(), m.sum()]).double()
    if process_group is not None:
        dist.all_reduce(stats, group=process_group)
    total, total_sq, n = stats.tolist()
    if n == 0:
        return list(values)
    mean = total / n
    var = max(total_sq / n - mean * mean, 0.0)
    if n >= 2:
        var *= n / (n - 1)
    out = (x - mean) / math.sqrt(var + WHITEN_EPS)
    return list(out.split([t.numel() for t in values]))


# ---------------------------------------------------------------------------------------------
# The entry point
# ---------------------------------------------------------------------------------------------


def compute_advantages_and_returns(
    cfg: AdvantageConfig,
    *,
    rewards: Tensor,
    group_index: Tensor,
    loss_masks: list[Tensor],
    log_probs: list[Tensor] | None = None,
    ref_log_probs: list[Tensor] | None = None,
    values: list[Tensor] | None = None,
    whiten_group: dist.ProcessGroup | None = None,
) -> tuple[list[Tensor], list[Tensor]]:
    """Per-token advantages and returns of a batch of samples (no gradient).

    rewards[i] is sample i's scalar reward, group_index[i] its prompt group. Every sample of a
    group must be in this call (the group baseline needs them all): call it on the whole
    rollout, or partition data-parallel ranks by group. ``log_probs``/``ref_log_probs`` are
    needed when ``kl_coef > 0``, ``values`` (the critic's, per token) for PPO.
    ``whiten_group``: the process group to take whitening statistics over (see
    ``masked_whiten``). Returns (advantages, returns), lists aligned with ``loss_masks``;
    ``returns`` are the critic's targets for PPO and equal the unwhitened advantages otherwise.
    """
    n = len(loss_masks)
    rewards = torch.as_tensor(rewards).float().reshape(-1)
    group_index = torch.as_tensor(group_index).reshape(-1)
    if rewards.numel() != n or group_index.numel() != n:
        raise ValueError(f"{n} loss masks but {rewards.numel()} rewards and {group_index.numel()} group ids")
    bad = torch.nonzero(~torch.isfinite(rewards)).reshape(-1)
    if bad.numel():
        raise ValueError(f"reward of sample {int(bad[0])} is {float(rewards[bad[0]])}; rewards must be finite")
    if n == 0:
        return [], []
    device = loss_masks[0].device
    rewards = rewards.to(device)
    masks = [m.float() for m in loss_masks]

    rewards = group_baseline(cfg, rewards, group_index.to(device))

    kl = _shaping_kl(cfg, masks, log_probs, ref_log_probs)

    kind = estimator(cfg.estimator).advantage  # the kinds: rlslurm/settings/rl_settings.py
    if cfg.custom_advantage_function_path:
        if values is not None:
            check_same_lengths(masks, values=values)
        advantages, returns = _custom_advantages(cfg, AdvantageInputs(
            cfg=cfg, rewards=rewards.clone(), group_index=group_index.clone(), loss_masks=[m.clone() for m in masks],
            kl=kl, log_probs=[x.detach() for x in log_probs] if log_probs is not None else None,
            ref_log_probs=[x.detach() for x in ref_log_probs] if ref_log_probs is not None else None,
            values=[v.detach().float() for v in values] if values is not None else None,
        ))
    elif kind == "sequence":  # one advantage per sample
        advantages = [torch.full_like(m, float(r)) for m, r in zip(masks, rewards.tolist())]
        returns = advantages
    elif kind == "shaped_reward":
        advantages = [float(r) - cfg.kl_coef * k for r, k in zip(rewards.tolist(), kl)]
        returns = advantages
    elif kind == "discounted_return":
        returns = discounted_returns(_token_rewards(cfg, rewards, masks, kl), cfg.gamma)
        advantages = returns
    else:  # gae
        if values is None:
            raise ValueError(f"the {cfg.estimator} estimator needs the critic's values")
        check_same_lengths(masks, values=values)
        advantages, returns = gae(
            _token_rewards(cfg, rewards, masks, kl), [v.detach().float() for v in values], cfg.gamma, cfg.lam
        )

    if cfg.normalize_advantages:
        advantages = masked_whiten(advantages, masks, whiten_group)
    advantages = [a * m for a, m in zip(advantages, masks)]
    return advantages, [r.clone() for r in returns]


def _shaping_kl(
    cfg: AdvantageConfig,
    masks: list[Tensor],
    log_probs: list[Tensor] | None,
    ref_log_probs: list[Tensor] | None,
) -> list[Tensor]:
    if cfg.kl_coef == 0.0:
        return [torch.zeros_like(m) for m in masks]
    if log_probs is None or ref_log_probs is None:
        raise ValueError("--kl-coef > 0 needs log_probs and ref_log_probs")
    check_same_lengths(masks, log_probs=log_probs, ref_log_probs=ref_log_probs)
    return [
        kl_estimate(lp.detach(), ref.detach(), cfg.kl_estimator) * m
        for lp, ref, m in zip(log_probs, ref_log_probs, masks)
    ]


def _token_rewards(cfg: AdvantageConfig, rewards: Tensor, masks: list[Tensor], kl: list[Tensor]) -> list[Tensor]:
    """-kl_coef * KL on every masked token, plus the sequence reward on the last masked one."""
    out = []
    for r, m, k in zip(rewards.tolist(), masks, kl):
        tr = -cfg.kl_coef * k
        if tr.numel():
            tr[last_masked_index(m)] += r
        out.append(tr)
    return out


def _pad(xs: list[Tensor]) -> tuple[Tensor, list[int]]:
    lengths = [x.numel() for x in xs]
    padded = torch.zeros(len(xs), max(lengths, default=0), device=xs[0].device if xs else None)
    for i, x in enumerate(xs):
        padded[i, : x.numel()] = x.float()
    return padded, lengths
