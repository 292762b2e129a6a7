"""The actor's loss of one micro-batch, chosen by --loss-type (slime's names and meanings).

* ``policy_loss``: the RL loss (losses.compute_rl_loss);
* ``sft_loss``: the negative log-likelihood of the loss-masked response tokens, reduced like the
  RL loss (per sample or per token, over the global batch); advantages, KL, TIS and entropy do
  not enter it (rlslurm/settings/rl_settings.check_rl_settings refuses them);
* ``custom_loss``: the function named by --custom-loss-function-path (``module.path:fn`` or
  ``path/to/file.py:fn``), called once per micro-batch as ``fn(inputs) -> (loss, metrics)``
  with ``inputs`` a ``LossInputs``. ``loss`` must be this micro-batch's share of the global-batch
  mean: reduce per-token values with ``inputs.reduce`` (masked, with the global denominator), and
  the trainer sums gradients over micro-batches and data-parallel ranks. The trainer logs
  ``loss`` and the metrics named in the function's optional ``metric_keys`` attribute (a tuple of
  str: with pipeline parallelism the other stages must know the names before the loss runs); each
  such metric must be a scalar share like the loss.

Which of them a setting uses and what each reads is the registry's (rl_settings.LOSS_TYPES).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import Tensor

from rlslurm.settings.rl_settings import loss_type
from rlslurm.trainer.losses import PolicyLossConfig, compute_rl_loss, reduce_masked

LossResult = tuple[Tensor, dict[str, Tensor]]


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch, per sample 1-D tensors over its response tokens (losses.py's layout).

    ``log_probs`` carry the gradient, and so does ``entropy`` when --entropy-coef > 0.
    ``old_log_probs`` are the log-probs of the policy that sampled the batch (the trainer's,
    or the engine's with --use-rollout-logprobs), ``rollout_log_probs`` the engine's when
    every sample has them, ``ref_log_probs`` the reference model's when a KL setting loads it.
    ``advantages`` and ``returns`` are the estimator's (or --custom-advantage-function-path's).
    """

    cfg: PolicyLossConfig
    log_probs: list[Tensor]
    entropy: list[Tensor]
    loss_masks: list[Tensor]
    advantages: list[Tensor]
    returns: list[Tensor]
    old_log_probs: list[Tensor]
    ref_log_probs: list[Tensor] | None
    rollout_log_probs: list[Tensor] | None
    global_denominator: Tensor | float | None

    def reduce(self, per_token: list[Tensor]) -> Tensor:
        """This micro-batch's share of the global-batch mean of masked per-token values."""
        return reduce_masked(per_token, self.loss_masks, self.cfg.loss_reduction, self.global_denominator)


def policy_loss(x: LossInputs) -> LossResult:
    return compute_rl_loss(
        x.cfg, log_probs=x.log_probs, advantages=x.advantages, loss_masks=x.loss_masks,
        global_denominator=x.global_denominator, old_log_probs=x.old_log_probs, ref_log_probs=x.ref_log_probs,
        rollout_log_probs=x.rollout_log_probs, entropy=x.entropy,
    )


def sft_loss(x: LossInputs) -> LossResult:
    loss = -x.reduce(x.log_probs)
    return loss, {"loss": loss.detach()}


BUILT_IN: dict[str, Callable[[LossInputs], LossResult]] = {"policy_loss": policy_loss, "sft_loss": sft_loss}


def loss_function(cfg: PolicyLossConfig) -> Callable[[LossInputs], LossResult]:
    if loss_type(cfg.loss_type).plugin:
        assert cfg.custom_loss_function_path  # check_rl_settings
        from rlslurm.plugins import cached_callable

        return cached_callable(cfg.custom_loss_function_path, what="--custom-loss-function-path", min_args=1)
    return BUILT_IN[cfg.loss_type]


def metric_keys(cfg: PolicyLossConfig, *, have_ref: bool, have_rollout_logprobs: bool) -> list[str]:
    """The names every rank sums and logs, in a fixed order (the same on every pipeline stage)."""
    if not loss_type(cfg.loss_type).policy_gradient:
        extra = getattr(loss_function(cfg), "metric_keys", ()) if loss_type(cfg.loss_type).plugin else ()
        return ["loss", *(k for k in extra if k != "loss")]
    keys = ["loss", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy"]
    if have_ref:
        keys.append("kl")
    if cfg.use_tis:
        keys += ["tis", "tis_clipfrac", "tis_abs", "ois"]
    if have_rollout_logprobs:
        keys.append("train_rollout_logprob_abs_diff")
    return keys
