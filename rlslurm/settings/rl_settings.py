"""The RL settings' estimator registry and their one cross-field validator.

Every rule that ties two or more RL settings together lives in `check_rl_settings`: `resolve()`
runs it before anything is submitted, and the trainer runs the same function again at start-up
(`trainer/advantages.rl_configs_from_train`), so a combination the trainer refuses can never wait
in the queue first. Rules on one field alone are bounds in `rlslurm/settings/config.py`. No torch here:
this module is imported on the submit host.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from rlslurm.errors import ConfigError

# How an estimator turns the (group-normalised) scalar rewards into per-token advantages
# (trainer/advantages.compute_advantages_and_returns):
#   sequence          - the sample's reward on every token
#   shaped_reward     - the reward minus kl_coef * KL, token by token, not discounted
#   discounted_return - the discounted return of the token rewards (reward on the last trainable token)
#   gae               - generalised advantage estimation against a learned critic's values
AdvantageKind = Literal["sequence", "shaped_reward", "discounted_return", "gae"]

# The policy-gradient term of the actor loss (trainer/losses.compute_rl_loss):
#   token_clip    - PPO's clipped surrogate on each token's importance ratio
#   sequence_clip - the same on one ratio per sample, the geometric mean of its tokens' (GSPO)
#   cispo         - -sg(clip(ratio)) * A * log-prob: the clipped ratio only weighs the REINFORCE
#                   gradient, so clipped tokens still train (MiniMax-M1's CISPO)
PolicyGradient = Literal["token_clip", "sequence_clip", "cispo"]


@dataclass(frozen=True)
class Estimator:
    """What an advantage estimator needs and does (semantics: trainer/advantages.py)."""

    name: str
    advantage: AdvantageKind    # how the rewards become per-token advantages (above)
    group_baseline: bool        # the scalar reward is centred on its prompt group
    group_std: bool             # ... and divided by the group's std (--grpo-std-normalization)
    needs_whitening: bool       # no baseline for the token returns: --normalize-advantages required
    policy_gradient: PolicyGradient  # the policy-gradient term of the loss (above)

    @property
    def per_token_rewards(self) -> bool:
        """Token-level rewards, which a KL penalty (--kl-coef) can shape."""
        return self.advantage != "sequence"

    @property
    def sequence_ratio(self) -> bool:
        """GSPO's sequence-level importance ratio in the policy loss."""
        return self.policy_gradient == "sequence_clip"

    @property
    def dual_clip(self) -> bool:
        """The loss has PPO's clipped branch, which --eps-clip-c caps for negative advantages."""
        return self.policy_gradient != "cispo"

    @property
    def critic(self) -> bool:
        """A learned value model (--num-critic-only-steps, --critic-lr)."""
        return self.advantage == "gae"


_ALL = (
    Estimator("grpo", "sequence", group_baseline=True, group_std=True, needs_whitening=False,
              policy_gradient="token_clip"),
    Estimator("gspo", "sequence", group_baseline=True, group_std=True, needs_whitening=False,
              policy_gradient="sequence_clip"),
    # slime: GRPO's advantages with CISPO's loss; canonically --eps-clip 1 (no lower bound) and a
    # wide --eps-clip-high such as 4
    Estimator("cispo", "sequence", group_baseline=True, group_std=True, needs_whitening=False,
              policy_gradient="cispo"),
    Estimator("reinforce_plus_plus", "discounted_return", group_baseline=False, group_std=False, needs_whitening=True,
              policy_gradient="token_clip"),
    Estimator("reinforce_plus_plus_baseline", "shaped_reward", group_baseline=True, group_std=False,
              needs_whitening=True, policy_gradient="token_clip"),
    Estimator("ppo", "gae", group_baseline=False, group_std=False, needs_whitening=False, policy_gradient="token_clip"),
)
ESTIMATORS: dict[str, Estimator] = {e.name: e for e in _ALL}
ESTIMATOR_NAMES: tuple[str, ...] = tuple(ESTIMATORS)


def estimator(name: str) -> Estimator:
    try:
        return ESTIMATORS[name]
    except KeyError:
        raise ConfigError(f"--advantage-estimator must be one of {', '.join(ESTIMATOR_NAMES)}, got {name!r}") from None


def names_where(**want: bool) -> tuple[str, ...]:
    """Estimator names with the given properties, e.g. names_where(critic=True)."""
    return tuple(e.name for e in _ALL if all(getattr(e, k) == v for k, v in want.items()))


@dataclass(frozen=True)
class LossType:
    """What an actor loss (--loss-type) reads (the functions: trainer/actor_loss.py)."""

    name: str
    policy_gradient: bool   # the RL loss: advantages, clipping, TIS, KL and entropy terms
    plugin: bool            # the function comes from --custom-loss-function-path
    # the sampling policy's log-probs (LossInputs.old_log_probs): without it the trainer skips the
    # no-grad forward that recomputes them (trainer/step.prepare)
    reads_old_logprobs: bool = True


_LOSS_TYPES = (
    LossType("policy_loss", policy_gradient=True, plugin=False),
    # negative log-likelihood of the loss-masked response tokens; no advantages
    LossType("sft_loss", policy_gradient=False, plugin=False, reads_old_logprobs=False),
    LossType("custom_loss", policy_gradient=False, plugin=True),
)
LOSS_TYPES: dict[str, LossType] = {t.name: t for t in _LOSS_TYPES}
LOSS_TYPE_NAMES: tuple[str, ...] = tuple(LOSS_TYPES)


def loss_type(name: str) -> LossType:
    try:
        return LOSS_TYPES[name]
    except KeyError:
        raise ConfigError(f"--loss-type must be one of {', '.join(LOSS_TYPE_NAMES)}, got {name!r}") from None


class RLKnobs(Protocol):
    """The fields of `rlslurm.settings.config.TrainSection` the rules read."""

    advantage_estimator: str
    grpo_std_normalization: bool
    rewards_normalization: bool
    normalize_advantages: bool
    eps_clip: float
    eps_clip_high: float | None
    eps_clip_c: float | None
    use_kl_loss: bool
    kl_loss_coef: float
    use_unbiased_kl: bool
    kl_coef: float
    num_critic_only_steps: int
    use_tis: bool
    tis_clip_low: float
    tis_clip: float
    custom_tis_function_path: str | None
    use_rollout_logprobs: bool
    entropy_coef: float
    loss_type: str
    custom_loss_function_path: str | None
    custom_advantage_function_path: str | None


class ModelSources(Protocol):
    hf_checkpoint: Path | None
    ref_load: Path | None


def check_rl_settings(t: RLKnobs, model: ModelSources | None = None) -> None:
    """Raise a one-line ConfigError naming the flags of the first cross-field rule `t` breaks.

    `model` (the run config's model section) adds the rule that a KL penalty needs a reference
    model; without it that rule is skipped."""
    est = estimator(t.advantage_estimator)
    loss = loss_type(t.loss_type)
    kl_loss = t.kl_loss_coef if t.use_kl_loss else 0.0
    if loss.plugin and not t.custom_loss_function_path:
        raise ConfigError(f"--loss-type {loss.name} needs --custom-loss-function-path module.path:fn (or file.py:fn)")
    if t.custom_loss_function_path and not loss.plugin:
        raise ConfigError(
            f"--custom-loss-function-path is used only with --loss-type "
            f"{' or '.join(n for n, x in LOSS_TYPES.items() if x.plugin)}, not {loss.name}")
    if not loss.policy_gradient and not loss.plugin:
        unused = [flag for flag, on in (("--use-kl-loss --kl-loss-coef", kl_loss > 0), ("--kl-coef", t.kl_coef > 0),
                                        ("--use-tis", t.use_tis), ("--entropy-coef", t.entropy_coef > 0),
                                        ("--custom-advantage-function-path", bool(t.custom_advantage_function_path)))
                  if on]
        if unused:
            raise ConfigError(
                f"--loss-type {loss.name} is the log-likelihood of the responses alone; {', '.join(unused)} "
                f"would do nothing (use --loss-type policy_loss)")
    if t.kl_coef > 0 and kl_loss > 0:
        raise ConfigError(
            f"--kl-coef {t.kl_coef:g} (KL in the reward) and --use-kl-loss --kl-loss-coef {kl_loss:g} (KL in the "
            f"loss) are exclusive: penalise the KL in one place")
    if t.use_unbiased_kl and kl_loss == 0:
        raise ConfigError(
            "--use-unbiased-kl weights the KL loss by the new/old ratio; it needs --use-kl-loss --kl-loss-coef > 0 "
            "(--kl-coef's KL in the reward is computed before training and has no ratio)")
    # A custom advantage function replaces the estimator's advantages: it gets the --kl-coef KL
    # whatever the estimator, and whether its advantages need whitening is its own business.
    custom_adv = bool(t.custom_advantage_function_path)
    if t.kl_coef > 0 and not est.per_token_rewards and not custom_adv:
        raise ConfigError(
            f"--kl-coef shapes per-token rewards, which --advantage-estimator {est.name} does not have; use "
            f"--use-kl-loss --kl-loss-coef instead "
            f"(or an estimator of {', '.join(names_where(per_token_rewards=True))})")
    if not t.rewards_normalization and not est.group_baseline:
        # slime ignores it there; a setting that does nothing is a misunderstanding to point out
        raise ConfigError(
            f"--disable-rewards-normalization (--no-rewards-normalization) turns off the group baseline, which "
            f"--advantage-estimator {est.name} does not have (only {', '.join(names_where(group_baseline=True))})")
    if not t.grpo_std_normalization and t.rewards_normalization and not est.group_std:
        raise ConfigError(
            f"--disable-grpo-std-normalization (--no-grpo-std-normalization) turns off the division by the group's "
            f"std, which --advantage-estimator {est.name} does not do (only {', '.join(names_where(group_std=True))})")
    if est.needs_whitening and not t.normalize_advantages and not custom_adv:
        # REINFORCE++ has no learned or group baseline for the token returns; without whitening
        # the advantages' scale follows the raw reward scale.
        raise ConfigError(f"--advantage-estimator {est.name} needs --normalize-advantages")
    if t.num_critic_only_steps > 0 and not est.critic:
        raise ConfigError(
            f"--num-critic-only-steps {t.num_critic_only_steps} needs --advantage-estimator "
            f"{' or '.join(names_where(critic=True))} (only it has a critic), not {est.name}")
    if t.use_tis and t.use_rollout_logprobs:
        raise ConfigError(
            "--use-tis and --use-rollout-logprobs are exclusive: TIS corrects the trainer's old log-probs "
            "towards the engine's, which --use-rollout-logprobs already uses")
    if t.custom_tis_function_path and not t.use_tis:
        raise ConfigError("--custom-tis-function-path gives the weights of --use-tis; add --use-tis")
    if not t.tis_clip > t.tis_clip_low:
        raise ConfigError(f"--tis-clip {t.tis_clip:g} must be > --tis-clip-low {t.tis_clip_low:g}")
    high = t.eps_clip if t.eps_clip_high is None else t.eps_clip_high
    if t.eps_clip_c is not None and not est.dual_clip:
        raise ConfigError(
            f"--eps-clip-c caps PPO's clipped loss, which --advantage-estimator {est.name} does not have "
            f"(its clipped ratio only weighs the gradient)")
    if t.eps_clip_c is not None and t.eps_clip_c <= 1.0 + high:
        raise ConfigError(
            f"--eps-clip-c {t.eps_clip_c:g} must exceed 1 + --eps-clip-high ({1.0 + high:g}; --eps-clip-high "
            f"defaults to --eps-clip), else dual-clip cuts inside the PPO trust region")
    if model is not None and (kl_loss > 0 or t.kl_coef > 0) and model.hf_checkpoint is None and model.ref_load is None:
        what = "--use-kl-loss --kl-loss-coef" if kl_loss > 0 else "--kl-coef"
        raise ConfigError(f"{what} needs a reference model: pass --hf-checkpoint or --ref-load")
