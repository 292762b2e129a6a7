"""RL losses of the actor and the critic: clipped policy gradient, GSPO, CISPO, TIS, KL, entropy, value.

Semantics follow slime (``slime/utils/ppo_utils.py`` and ``backends/megatron_utils/loss.py``);
the code is our own. Every per-sample tensor is 1-D over that sample's *response* tokens, a
batch is a ``list[Tensor]``. All math is done in fp32 whatever the input dtype, so a bf16
model gets the same loss as an fp32 one up to the precision of its log-probs.

How the trainer uses this module, once per micro-batch::

    denom = local_denominator(all_masks_of_my_step, cfg.loss_reduction)   # then all_reduce SUM over DP
    loss, metrics = compute_rl_loss(cfg, log_probs=..., advantages=..., loss_masks=...,
                                    global_denominator=denom, ...)
    loss.backward()      # gradients must be SUMMED over micro-batches and DP ranks

Every value returned (loss and metrics) is this micro-batch's *share* of the mean over the
whole global batch, so summing them over micro-batches and DP ranks gives the global means.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from rlslurm.errors import ConfigError
from rlslurm.settings.rl_settings import estimator, loss_type

KLKind = Literal["k1", "k2", "k3", "low_var_kl"]
LossReduction = Literal["per_sample_mean", "per_token"]

KL_KINDS: tuple[str, ...] = ("k1", "k2", "k3", "low_var_kl")
LOSS_REDUCTIONS: tuple[str, ...] = ("per_sample_mean", "per_token")
# slime clamps low_var_kl to +-10: with a log-ratio of a few tens exp() overflows fp32 first.
LOW_VAR_KL_CLAMP = 10.0


@dataclass(frozen=True)
class PolicyLossConfig:
    """Knobs of the actor loss. Flag names in errors are the CLI's (slime's) spelling.

    ``eps_clip_high=None`` means symmetric clipping (= ``eps_clip``); set it larger for
    DAPO's clip-higher. ``eps_clip_c`` enables dual-clip PPO: for negative advantages the
    loss is capped at ``-eps_clip_c * A`` so a huge ratio on a bad token cannot explode.
    TIS multiplies the per-token loss by ``clamp(exp(old - rollout), tis_clip_low, tis_clip_high)``
    to correct for the engine and the trainer disagreeing on log-probs; ``custom_tis_function_path``
    (with ``use_tis``) computes those weights instead (``TISInputs``; MIS/icepop-style rules).
    """

    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    eps_clip_c: float | None = None
    use_tis: bool = False
    tis_clip_low: float = 0.0
    tis_clip_high: float = 2.0
    kl_loss_coef: float = 0.0
    kl_loss_type: KLKind = "k1"
    use_unbiased_kl: bool = False
    entropy_coef: float = 0.0
    loss_reduction: LossReduction = "per_sample_mean"
    estimator: str = "grpo"
    loss_type: str = "policy_loss"                  # a name of rlslurm/settings/rl_settings.LOSS_TYPES
    custom_loss_function_path: str | None = None    # --loss-type custom_loss (trainer/actor_loss.py)
    custom_tis_function_path: str | None = None     # --use-tis weights of one's own (`TISInputs`)

    def __post_init__(self) -> None:
        loss_type(self.loss_type)
        if self.eps_clip_high is None:
            object.__setattr__(self, "eps_clip_high", self.eps_clip)
        # The lower bound 1 - eps_clip must stay a ratio a policy can have (>= 0); eps 0 would
        # clip every token and train nothing.
        if not 0.0 < self.eps_clip <= 1.0:
            raise ConfigError(f"--eps-clip must be in (0, 1], got {self.eps_clip}")
        assert self.eps_clip_high is not None
        if not self.eps_clip_high > 0.0:
            raise ConfigError(f"--eps-clip-high must be > 0, got {self.eps_clip_high}")
        if self.eps_clip_c is not None and not self.eps_clip_c > 1.0:
            # A cap at or below 1 would cut the loss of ordinary unclipped tokens too.
            raise ConfigError(f"--eps-clip-c (dual-clip bound) must be > 1.0, got {self.eps_clip_c}")
        # --eps-clip-c vs --eps-clip-high and --tis-clip vs --tis-clip-low are rules across settings:
        # rlslurm/settings/rl_settings.check_rl_settings.
        if self.tis_clip_low < 0.0:
            raise ConfigError(f"--tis-clip-low must be >= 0, got {self.tis_clip_low}")
        if self.kl_loss_coef < 0.0:
            raise ConfigError(f"--kl-loss-coef must be >= 0, got {self.kl_loss_coef}")
        if self.kl_loss_type not in KL_KINDS:
            raise ConfigError(f"--kl-loss-type must be one of {KL_KINDS}, got {self.kl_loss_type!r}")
        if self.entropy_coef < 0.0:
            raise ConfigError(f"--entropy-coef must be >= 0, got {self.entropy_coef}")
        if self.loss_reduction not in LOSS_REDUCTIONS:
            raise ConfigError(
                f"loss_reduction (--calculate-per-token-loss) must be one of {LOSS_REDUCTIONS}, "
                f"got {self.loss_reduction!r}"
            )

    @property
    def clip_high(self) -> float:
        assert self.eps_clip_high is not None  # resolved in __post_init__
        return self.eps_clip_high


# ---------------------------------------------------------------------------------------------
# Per-token building blocks (1-D tensors, or any matching shapes)
# ---------------------------------------------------------------------------------------------


def kl_estimate(
    logp: Tensor, ref_logp: Tensor, kind: str, clamp: float | None = None, importance_ratio: Tensor | None = None
) -> Tensor:
    """Per-token estimate of KL(pi || ref) from the sampled token's log-probs (Schulman's k1/k2/k3).

    k1 = log r, k2 = (log r)^2 / 2, k3 = exp(-log r) - 1 + log r with log r = logp - ref_logp.
    k3 ("low_var_kl") is unbiased and never negative. ``low_var_kl`` is clamped to
    [-10, 10] as in slime; ``clamp`` overrides the bound (or adds one to the other kinds).

    ``importance_ratio`` (--use-unbiased-kl, DeepSeek-V3.2): the tokens were sampled from the old
    policy, not from pi, so the estimate is weighted by pi/pi_old to stay unbiased after the
    first step on a batch. The weight keeps its gradient (the estimate's expectation under
    pi_old is the KL, so its gradient is the KL's) and is applied before the clamp, as in slime.
    """
    log_ratio = logp.float() - ref_logp.float()
    if kind == "k1":
        kl = log_ratio
    elif kind == "k2":
        kl = 0.5 * log_ratio.square()
    elif kind in ("k3", "low_var_kl"):
        kl = torch.expm1(-log_ratio) + log_ratio
    else:
        raise ValueError(f"unknown KL estimator {kind!r}; expected one of {KL_KINDS}")
    if importance_ratio is not None:
        kl = importance_ratio.float() * kl
    bound = clamp if clamp is not None else (LOW_VAR_KL_CLAMP if kind == "low_var_kl" else None)
    if bound is not None:
        kl = kl.clamp(-bound, bound)
    return kl


def clipped_surrogate(
    ratio: Tensor,
    advantages: Tensor,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None = None,
) -> tuple[Tensor, Tensor]:
    """PPO's pessimistic clipped objective as a loss, given the importance ratio directly.

    Returns (per-token loss, per-token clip indicator). A token counts as clipped when the
    clipped branch is the one that bounds the loss (strictly), so a ratio exactly at
    1 +- eps is not clipped. Dual-clip only ever lowers the loss of negative-advantage tokens.
    """
    ratio = ratio.float()
    advantages = advantages.float()
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high) * advantages
    loss = torch.maximum(unclipped, clipped)
    clipfrac = (clipped > unclipped).float()
    if eps_clip_c is not None:
        capped = torch.minimum(loss, -eps_clip_c * advantages)
        loss = torch.where(advantages < 0, capped, loss)
    return loss, clipfrac


def policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Token-level clipped policy-gradient loss (PPO/GRPO/REINFORCE++).

    Returns (per-token loss, per-token clip indicator, per-token ``old - new`` log-ratio,
    whose masked mean is the ``ppo_kl`` metric).
    """
    ppo_kl = old_log_probs.float() - log_probs.float()
    loss, clipfrac = clipped_surrogate(torch.exp(-ppo_kl), advantages, eps_clip, eps_clip_high, eps_clip_c)
    return loss, clipfrac, ppo_kl


def cispo_policy_loss(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, eps_clip: float, eps_clip_high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """CISPO (MiniMax-M1): loss -sg(clamp(ratio, 1 - eps_clip, 1 + eps_clip_high)) * A * log_prob.

    The ratio is clipped under stop-gradient and only weighs the REINFORCE gradient -w * A * grad
    log_prob, so a clipped token still trains (PPO's clipped branch gives it no gradient). The
    loss *value* is not PPO's. A token counts as clipped when the clamp changed its ratio.
    Returns (per-token loss, per-token clip indicator, per-token ``old - new`` log-ratio).
    """
    ppo_kl = old_log_probs.float() - log_probs.float()
    ratio = torch.exp(-ppo_kl.detach())
    weight = ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    loss = -weight * advantages.float() * log_probs.float()
    return loss, (weight != ratio).float(), ppo_kl


def sequence_log_ratio(log_probs: Tensor, old_log_probs: Tensor, mask: Tensor) -> Tensor:
    """Masked mean over one sample of ``old - new`` (scalar); GSPO's sequence-level log-ratio."""
    m = mask.float()
    return ((old_log_probs.float() - log_probs.float()) * m).sum() / m.sum().clamp_min(1.0)


def gspo_policy_loss(
    log_probs: list[Tensor],
    old_log_probs: list[Tensor],
    advantages: list[Tensor],
    loss_masks: list[Tensor],
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None = None,
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """GSPO: one importance ratio per sample, the geometric mean of its token ratios.

    Each token of sample i uses ratio_i = exp(mean_t(new - old)) over its loss-masked tokens,
    so clipping acts on whole sequences (GSPO's eps are therefore ~1e-3, not 0.2). Gradients
    flow through the mean into every masked token. Returns per-sample lists of
    (per-token loss, clip indicator, per-token copy of the sequence log-ratio).
    """
    check_same_lengths(log_probs, old_log_probs=old_log_probs, advantages=advantages, loss_masks=loss_masks)
    losses, clipfracs, kls = [], [], []
    for lp, old, adv, mask in zip(log_probs, old_log_probs, advantages, loss_masks, strict=True):
        seq_kl = sequence_log_ratio(lp, old, mask).expand(lp.shape)
        loss, clipfrac = clipped_surrogate(torch.exp(-seq_kl), adv, eps_clip, eps_clip_high, eps_clip_c)
        losses.append(loss)
        clipfracs.append(clipfrac)
        kls.append(seq_kl)
    return losses, clipfracs, kls


def tis_weights(
    train_old_logp: Tensor, rollout_logp: Tensor, low: float, high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Truncated importance sampling between the trainer's and the engine's log-probs.

    The engine sampled from its own numerics (rollout_logp); the loss assumes the trainer's
    (train_old_logp). Weight = clamp(exp(train - rollout), low, high), without gradient.
    Returns (weights, raw ratios, per-token clip indicator).
    """
    ratio = torch.exp(train_old_logp.detach().float() - rollout_logp.detach().float())
    weights = ratio.clamp(low, high)
    return weights, ratio, (weights != ratio).float()


@dataclass(frozen=True)
class TISInputs:
    """What --custom-tis-function-path's function gets, for one sample over its response tokens
    (no gradient): the trainer's old log-probs, the engine's, the loss mask, and the TIS bounds
    (--tis-clip-low, --tis-clip). It returns one non-negative weight per token, which multiplies the
    token's policy-gradient loss: e.g. 0 outside [low, high] (icepop), or one weight for the whole
    sample from its mean log-ratio (sequence-level MIS)."""

    old_log_probs: Tensor
    rollout_log_probs: Tensor
    loss_mask: Tensor
    low: float
    high: float


def custom_tis_weights(spec: str, inputs: TISInputs) -> tuple[Tensor, Tensor, Tensor]:
    """`tis_weights`' contract with the weights from the plugin, checked: one finite weight >= 0
    per token. The clip indicator marks the tokens whose weight is not the raw ratio."""
    ratio = torch.exp(inputs.old_log_probs.float() - inputs.rollout_log_probs.float())
    from rlslurm.plugins import cached_callable

    fn: Callable[[TISInputs], Tensor] = cached_callable(spec, what="--custom-tis-function-path", min_args=1)
    w = fn(inputs)
    if not isinstance(w, Tensor) or w.shape != ratio.shape:
        raise ConfigError(f"--custom-tis-function-path {spec}: must return a tensor of shape {tuple(ratio.shape)} "
                          f"(one weight per token), "
                          f"got {tuple(w.shape) if isinstance(w, Tensor) else type(w).__name__}")
    w = w.detach().float().to(ratio.device)
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ConfigError(f"--custom-tis-function-path {spec}: weights must be finite and >= 0")
    return w, ratio, (w != ratio).float()


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, clip: float) -> tuple[Tensor, Tensor]:
    """PPO's clipped value loss per token: max((V_clipped - R)^2, (V - R)^2).

    V_clipped = old + clamp(V - old, -clip, clip). No factor 1/2 (slime's convention).
    Returns (per-token loss, per-token indicator |V - old| > clip).
    """
    if not clip > 0.0:
        raise ConfigError(f"--value-clip must be > 0, got {clip}")
    values, old_values, returns = values.float(), old_values.float(), returns.float()
    delta = values - old_values
    clipped = old_values + delta.clamp(-clip, clip)
    loss = torch.maximum((clipped - returns).square(), (values - returns).square())
    return loss, (delta.abs() > clip).float()


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim, in fp32: [..., V] -> [...]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


# ---------------------------------------------------------------------------------------------
# Reduction: the data-parallel subtlety lives here
# ---------------------------------------------------------------------------------------------


def local_denominator(loss_masks: list[Tensor], mode: str) -> Tensor:
    """This rank's part of the global denominator for ``reduce_masked`` (fp32 scalar).

    per_sample_mean: the number of samples; per_token: the number of loss-masked tokens.
    Sum it over every micro-batch of the optimizer step on this rank, then all_reduce(SUM)
    over the data-parallel group (with context parallel ranks counted once), and pass the
    result as ``global_denominator`` to every micro-batch of the step. Filler micro-batches
    (a sample repeated with an all-zero mask so that every DP rank runs as many micro-batches,
    see batching.py) are left out: under per_sample_mean a zero mask would still count a sample.
    """
    _check_mode(mode)
    # On the masks' device, so that it can go straight into an NCCL all_reduce.
    device = loss_masks[0].device if loss_masks else None
    if mode == "per_sample_mean":
        return torch.tensor(float(len(loss_masks)), device=device)
    return _cat(loss_masks).float().sum()


def reduce_masked(
    per_token: list[Tensor],
    masks: list[Tensor],
    mode: str,
    global_denominator: float | Tensor | None = None,
) -> Tensor:
    """Reduce per-token values of some samples to their share of the global-batch mean.

    ``per_sample_mean``: each sample is first averaged over its own masked tokens (long and
    short answers weigh the same), then samples are summed and divided by the number of
    samples in the *global* batch. ``per_token``: masked tokens are summed and divided by the
    number of masked tokens in the *global* batch (every token weighs the same; Dr.GRPO/DAPO).

    Why a global denominator: an optimizer step sees G samples split over M micro-batches
    and D data-parallel ranks. Dividing inside each micro-batch by its own count and then
    averaging micro-batches weighs a token of a small micro-batch more than one of a big
    one, so the step would not be the mean the estimator assumes (and it would change with
    M and D). With the global denominator every micro-batch returns exactly its share, and
    the sum over micro-batches and ranks is the global mean whatever the split. The caller
    must therefore *sum* gradients over micro-batches and ranks: if Megatron divides the
    loss by num_microbatches and DDP averages over D, multiply the loss by
    ``num_microbatches * D`` first (slime does the same).

    ``global_denominator=None`` uses this call's own count: right only when the call sees
    the whole global batch (single process, one micro-batch). Masked tokens (tool output,
    padding) contribute nothing. A sample with an all-zero mask contributes 0.
    """
    _check_mode(mode)
    check_same_lengths(per_token, masks=masks)
    if not per_token:
        return torch.zeros(())
    if global_denominator is None:
        global_denominator = local_denominator(masks, mode)
    x, m = _cat(per_token).float(), _cat(masks).to(per_token[0].device).float()
    if mode == "per_sample_mean":
        # Per-sample masked sums via one index_add instead of a kernel per sample.
        lengths = torch.tensor([t.numel() for t in per_token], device=x.device)
        sample_of_token = torch.repeat_interleave(torch.arange(len(per_token), device=x.device), lengths)
        sums = torch.zeros(len(per_token), device=x.device).index_add(0, sample_of_token, x * m)
        counts = torch.zeros(len(per_token), device=x.device).index_add(0, sample_of_token, m)
        total = (sums / counts.clamp_min(1.0)).sum()
    else:
        total = (x * m).sum()
    denom = torch.as_tensor(global_denominator, dtype=torch.float32, device=x.device)
    return total / denom.clamp_min(1.0)


# ---------------------------------------------------------------------------------------------
# The actor and critic losses of one micro-batch
# ---------------------------------------------------------------------------------------------


def compute_rl_loss(
    cfg: PolicyLossConfig,
    *,
    log_probs: list[Tensor],
    advantages: list[Tensor],
    loss_masks: list[Tensor],
    global_denominator: float | Tensor | None,
    old_log_probs: list[Tensor] | None = None,
    ref_log_probs: list[Tensor] | None = None,
    rollout_log_probs: list[Tensor] | None = None,
    entropy: list[Tensor] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Actor loss of one micro-batch: policy gradient (+TIS) - entropy bonus + KL loss.

    ``log_probs`` carry the gradient. ``old_log_probs`` are the trainer's log-probs of the
    policy that generated the batch (None: the current ones detached, i.e. the first step
    on fresh data, ratio 1). ``rollout_log_probs`` are the engine's; they are needed for TIS
    and give the ``train_rollout_logprob_abs_diff`` metric. ``entropy`` (per-token, with
    gradient) is needed when ``entropy_coef > 0`` and reported when given. ``ref_log_probs``
    are needed when ``kl_loss_coef > 0``.

    Returns (loss, metrics): loss, pg_loss, pg_clipfrac, ppo_kl, and when their inputs are
    given entropy, kl (to the reference, with ``kl_loss_type``), tis, tis_clipfrac, tis_abs,
    ois (the new/old ratio), train_rollout_logprob_abs_diff.
    All are this micro-batch's share of the global-batch mean (see ``reduce_masked``);
    metrics are detached.
    """
    check_same_lengths(log_probs, advantages=advantages, loss_masks=loss_masks)
    if old_log_probs is None:
        old_log_probs = [lp.detach() for lp in log_probs]
    check_same_lengths(log_probs, old_log_probs=old_log_probs)

    def reduce(xs: list[Tensor]) -> Tensor:
        return reduce_masked(xs, loss_masks, cfg.loss_reduction, global_denominator)

    pg, clipfrac, ppo_kl = _policy_gradient(cfg, log_probs, old_log_probs, advantages, loss_masks)

    metrics: dict[str, Tensor] = {}
    if cfg.use_tis:
        if rollout_log_probs is None:
            raise ValueError("use_tis needs rollout_log_probs (the engine's token log-probs)")
        check_same_lengths(log_probs, rollout_log_probs=rollout_log_probs)
        pg, tis_metrics = _tis_weighted(cfg, pg, old_log_probs, rollout_log_probs, loss_masks, ppo_kl, reduce)
        metrics.update(tis_metrics)

    pg_loss = reduce(pg)
    loss = pg_loss
    metrics["pg_loss"] = pg_loss
    metrics["pg_clipfrac"] = reduce(clipfrac)
    metrics["ppo_kl"] = reduce(ppo_kl)

    if entropy is not None:
        check_same_lengths(log_probs, entropy=entropy)
        entropy_mean = reduce(entropy)
        metrics["entropy"] = entropy_mean
        loss = loss - cfg.entropy_coef * entropy_mean
    elif cfg.entropy_coef > 0.0:
        raise ValueError("entropy_coef > 0 needs the per-token entropy of the current policy")

    if cfg.kl_loss_coef > 0.0 and ref_log_probs is None:
        raise ValueError("kl_loss_coef > 0 needs ref_log_probs (the reference model's log-probs)")
    if ref_log_probs is not None:
        # Reported whenever the reference is at hand: the drift from it is worth watching
        # even when it is penalised in the reward (--kl-coef) or not at all.
        kl = reduce(_kl_to_reference(cfg, log_probs, old_log_probs, ref_log_probs))
        metrics["kl"] = kl
        if cfg.kl_loss_coef > 0.0:
            loss = loss + cfg.kl_loss_coef * kl

    if rollout_log_probs is not None:
        check_same_lengths(log_probs, rollout_log_probs=rollout_log_probs)
        metrics["train_rollout_logprob_abs_diff"] = reduce(
            [(old.float() - roll.float()).abs() for old, roll in zip(old_log_probs, rollout_log_probs)]
        )

    metrics["loss"] = loss
    return loss, {k: v.detach() for k, v in metrics.items()}


def _policy_gradient(
    cfg: PolicyLossConfig,
    log_probs: list[Tensor],
    old_log_probs: list[Tensor],
    advantages: list[Tensor],
    loss_masks: list[Tensor],
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Per sample, by the estimator's kind of policy gradient: the per-token loss, the clip fractions
    and the new/old log-ratios (ppo_kl)."""
    kind = estimator(cfg.estimator).policy_gradient  # the kinds: rlslurm/settings/rl_settings.py
    if kind == "sequence_clip":  # GSPO
        return gspo_policy_loss(
            log_probs, old_log_probs, advantages, loss_masks, cfg.eps_clip, cfg.clip_high, cfg.eps_clip_c
        )
    # One fused elementwise pass over the micro-batch instead of a few kernels per sample.
    lengths = [lp.numel() for lp in log_probs]
    if kind == "cispo":
        flat = cispo_policy_loss(
            _cat(log_probs), _cat(old_log_probs), _cat(advantages), cfg.eps_clip, cfg.clip_high
        )
    else:
        flat = policy_loss(
            _cat(log_probs), _cat(old_log_probs), _cat(advantages), cfg.eps_clip, cfg.clip_high, cfg.eps_clip_c
        )
    pg, clipfrac, ppo_kl = (list(t.split(lengths)) for t in flat)
    return pg, clipfrac, ppo_kl


def _tis_weighted(
    cfg: PolicyLossConfig,
    pg: list[Tensor],
    old_log_probs: list[Tensor],
    rollout_log_probs: list[Tensor],
    loss_masks: list[Tensor],
    ppo_kl: list[Tensor],
    reduce: Callable[[list[Tensor]], Tensor],
) -> tuple[list[Tensor], dict[str, Tensor]]:
    """TIS: each sample's policy-gradient loss weighted by its truncated trainer/engine importance
    ratio (--custom-tis-function-path's, where given), and the metrics of TIS, reduced like the loss:
    the ratios, their clip fraction and distance from 1, and the new/old ratio (ois)."""
    weighted, ratios, tis_clip = [], [], []
    for loss_i, old, roll, mask in zip(pg, old_log_probs, rollout_log_probs, loss_masks):
        if cfg.custom_tis_function_path:
            w, r, c = custom_tis_weights(cfg.custom_tis_function_path, TISInputs(
                old.detach(), roll.detach(), mask.detach(), cfg.tis_clip_low, cfg.tis_clip_high))
        else:
            w, r, c = tis_weights(old, roll, cfg.tis_clip_low, cfg.tis_clip_high)
        weighted.append(loss_i * w)
        ratios.append(r)
        tis_clip.append(c)
    return weighted, {
        "tis": reduce(ratios),
        "tis_clipfrac": reduce(tis_clip),
        "tis_abs": reduce([(r - 1.0).abs() for r in ratios]),
        "ois": reduce([torch.exp(-k) for k in ppo_kl]),
    }


def _kl_to_reference(
    cfg: PolicyLossConfig,
    log_probs: list[Tensor],
    old_log_probs: list[Tensor],
    ref_log_probs: list[Tensor],
) -> list[Tensor]:
    """Per sample, the per-token KL estimate of the current policy to the reference (--kl-loss-type)."""
    check_same_lengths(log_probs, ref_log_probs=ref_log_probs)
    # --use-unbiased-kl: the ratio to the policy that sampled the tokens (1 on the first step)
    weights = ([torch.exp(lp.float() - old.float()) for lp, old in zip(log_probs, old_log_probs)]
               if cfg.use_unbiased_kl else [None] * len(log_probs))
    return [kl_estimate(lp, ref, cfg.kl_loss_type, importance_ratio=w)
            for lp, ref, w in zip(log_probs, ref_log_probs, weights)]


def compute_value_loss(
    *,
    values: list[Tensor],
    old_values: list[Tensor],
    returns: list[Tensor],
    loss_masks: list[Tensor],
    value_clip: float,
    loss_reduction: str,
    global_denominator: float | Tensor | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Critic loss of one micro-batch (PPO), reduced like the actor loss.

    Returns (loss, {"value_loss", "value_clipfrac"}), shares of the global-batch mean.
    """
    check_same_lengths(values, old_values=old_values, returns=returns, loss_masks=loss_masks)
    losses, clips = [], []
    for v, old, ret in zip(values, old_values, returns):
        loss_i, clip_i = value_loss(v, old, ret, value_clip)
        losses.append(loss_i)
        clips.append(clip_i)
    loss = reduce_masked(losses, loss_masks, loss_reduction, global_denominator)
    clipfrac = reduce_masked(clips, loss_masks, loss_reduction, global_denominator)
    return loss, {"value_loss": loss.detach(), "value_clipfrac": clipfrac.detach()}


def _cat(xs: list[Tensor]) -> Tensor:
    return torch.cat([x.reshape(-1) for x in xs]) if xs else torch.zeros(0)


def _check_mode(mode: str) -> None:
    if mode not in LOSS_REDUCTIONS:
        raise ValueError(f"unknown loss reduction {mode!r}; expected one of {LOSS_REDUCTIONS}")


def check_same_lengths(reference: list[Tensor], **others: list[Tensor]) -> None:
    """Catch a trainer bug (misaligned samples) here, not as a silently wrong loss."""
    for name, other in others.items():
        if len(other) != len(reference):
            raise ValueError(f"{name} has {len(other)} samples, expected {len(reference)}")
        for i, (a, b) in enumerate(zip(reference, other)):
            if a.shape != b.shape:
                raise ValueError(f"{name}[{i}] has shape {tuple(b.shape)}, expected {tuple(a.shape)}")
