"""One rollout's training: recompute old/ref log-probs and values, advantages, then
`num_steps_per_rollout` optimizer steps (actor, and the critic for PPO).

Every forward goes through `pipeline.run_microbatches`: a plain micro-batch loop with PP = 1,
megatron's 1F1B schedule with PP > 1 (the loss closures below run on the last stage). Gradient
semantics follow `losses.py`: every micro-batch's loss is its share of the global-batch mean,
gradients are summed over micro-batches and over DP ranks (the loss is multiplied by the DP size
because megatron's DDP averages; by DP x CP with context parallelism, where every CP rank computes
the same loss on whole sequences and DDP also sums over the CP ranks: docs/context-parallel.md). What only the last
stage computes (log-probs, values, loss metrics) is broadcast to the other stages, so every rank holds the same
`Prepared` and metrics.

Filler micro-batches of the plan (batching.py: they keep every DP rank's micro-batch count equal,
which expert parallelism's collectives need) run like the others, with an all-zero loss mask:
their outputs are dropped, their loss and metrics are exactly 0 and they are in no denominator.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from rlslurm.buffer.sample import Rollout, SampleStatus
from rlslurm.errors import DataError
from rlslurm.settings.rl_settings import loss_type
from rlslurm.step_line import GEN_TOK_S
from rlslurm.trainer import actor_loss, logprobs as lp, pipeline
from rlslurm.trainer.advantages import (
    actor_trains,
    compute_advantages_and_returns,
    group_baseline,
    post_processed_rewards,
    reward_from,
)
from rlslurm.trainer.batching import BatchPlan, MicroBatch, collate, collate_packed, plan_batches
from rlslurm.trainer.losses import compute_value_loss, local_denominator
from rlslurm.trainer.setup import Trained, TrainerSetup


@dataclass
class Prepared:
    """Per local sample (by rollout index): everything fixed for the whole rollout."""

    plan: BatchPlan
    masks: dict[int, Tensor]
    old_logprobs: dict[int, Tensor]
    advantages: dict[int, Tensor]
    returns: dict[int, Tensor]
    ref_logprobs: dict[int, Tensor] | None = None
    values: dict[int, Tensor] | None = None
    rollout_logprobs: dict[int, Tensor] | None = None
    times: dict[str, float] = field(default_factory=dict)


def _where(rollout: Rollout, i: int) -> str:
    return f"rollout {rollout.rollout_id} sample {i}"


def check_rollout(rollout: Rollout, vocab_size: int, max_len: int) -> None:
    for i, s in enumerate(rollout.samples):
        w = _where(rollout, i)
        s.validate(w)
        if len(s.prompt_tokens) == 0:
            raise DataError(w, "empty prompt: the first response token has no context to be scored in")
        if s.response_length == 0:
            raise DataError(w, "empty response")
        toks = s.tokens
        if toks.min() < 0 or toks.max() >= vocab_size:
            raise DataError(w, f"token id {int(toks.max() if toks.max() >= vocab_size else toks.min())} is outside "
                               f"the model's vocabulary [0, {vocab_size})")
        if len(toks) > max_len:
            raise DataError(w, f"{len(toks)} tokens exceed the model's max_position_embeddings {max_len}")


def make_plan(st: TrainerSetup, rollout: Rollout) -> BatchPlan:
    t = st.cfg.train
    return plan_batches(
        [len(s.prompt_tokens) + s.response_length for s in rollout.samples],
        num_steps=t.num_steps_per_rollout, dp=st.par.dp, dp_rank=st.par.dp_rank,
        micro_batch_size=t.micro_batch_size, global_batch_size=t.global_batch_size,
        # a micro-batch's tokens are spread over the CP ranks: its budget is --max-tokens-per-gpu x CP
        # (slime's rule, docs/context-parallel.md)
        max_tokens_per_gpu=t.max_tokens_per_gpu * st.par.cp if t.use_dynamic_batch_size else None,
        packed=_packed(st), where=f"rollout {rollout.rollout_id}",
    )


def _packed(st: TrainerSetup) -> bool:
    return st.cfg.train.qkv_format == "thd"


def step_microbatches(rollout: Rollout, plan: BatchPlan, k: int, device: torch.device, pad_multiple: int,
                      packed: bool = False, segment_multiple: int = 1) -> list[MicroBatch]:
    """Step k's micro-batches on this rank in the order they run: the real ones, then fillers.
    `segment_multiple`: packed, each sample padded to it (pipeline.segment_multiple)."""
    if packed:
        make = functools.partial(collate_packed, segment_multiple=segment_multiple)
    else:
        make = collate
    real = [make(rollout.samples, idx, device, pad_multiple) for idx in plan.steps[k]]
    return real + [make(rollout.samples, [i], device, pad_multiple, filler=True) for i in plan.fillers[k]]


def _masks(prep: Prepared, mb: MicroBatch) -> list[Tensor]:
    if mb.filler:
        return [torch.zeros_like(prep.masks[i]) for i in mb.indices]
    return [prep.masks[i] for i in mb.indices]


@torch.no_grad()
def _forward_all(model: torch.nn.Module, rollout: Rollout, plan: BatchPlan, st: TrainerSetup,
                 values: bool) -> dict[int, Tensor]:
    """Per local sample: log-probs of the response tokens under `model` (or the critic's values),
    on every pipeline stage. All micro-batches of the rollout, fillers included (the expert
    dispatch needs every rank's count), go through one schedule call."""

    def per_sample(output: Tensor, mb: MicroBatch) -> tuple[Tensor, list[Tensor]]:
        if values:
            per = lp.values_of(output, mb)
        else:
            x = lp.prepare_logits(output, st.vocab_size, st.cfg.rollout.rollout_temperature)
            per = lp.response_slices(lp.token_logprobs(x, mb.tokens, lp.cp_slice(mb)), mb)
        return output.new_zeros(()), [t.float().clone() for t in per]

    was_training = model.training
    model.eval()
    pad = pipeline.seq_multiple(model)
    seg = pipeline.segment_multiple(model)
    mbs = [mb for k in range(len(plan.steps))
           for mb in step_microbatches(rollout, plan, k, st.device, pad, _packed(st), seg)]
    out: dict[int, Tensor] = {}
    for mb, per in zip(mbs, pipeline.run_microbatches(model, mbs, per_sample, forward_only=True)):
        if not mb.filler:
            out.update(zip(mb.indices, per))
    model.train(was_training)  # the frozen reference stays in eval mode
    local = plan.local_indices()
    return pipeline.share_per_sample(out, local, {i: rollout.samples[i].response_length for i in local}, st.device)


def rewards_of(st: TrainerSetup, rollout: Rollout) -> Tensor:
    key = st.cfg.rollout.reward_key
    r = torch.tensor([reward_from(s.reward, s.reward_key or key, _where(rollout, i))
                      for i, s in enumerate(rollout.samples)], dtype=torch.float32)
    # The group baseline needs every sample of a group; groups span DP ranks, so do it over the
    # whole rollout here (every rank has it) and let the local call skip it (`prepare`).
    if st.adv_cfg.custom_reward_post_process_path:
        return post_processed_rewards(st.adv_cfg.custom_reward_post_process_path, rollout.samples, r)
    return group_baseline(st.adv_cfg, r, torch.tensor([s.group_index for s in rollout.samples]))


def prepare(st: TrainerSetup, rollout: Rollout) -> Prepared:
    t0 = time.perf_counter()
    plan = make_plan(st, rollout)
    local = plan.local_indices()
    samples = rollout.samples
    masks = {i: torch.from_numpy(samples[i].effective_loss_mask().astype("float32")).to(st.device) for i in local}
    for i in local:
        if samples[i].status in (SampleStatus.ABORTED, SampleStatus.FAILED):
            masks[i] = torch.zeros_like(masks[i])  # never train on a response the engine did not finish
    have_rollout_lp = all(s.rollout_logprobs is not None for s in samples)
    rollout_lp = ({i: torch.from_numpy(samples[i].rollout_logprobs.astype("float32")).to(st.device) for i in local}
                  if have_rollout_lp else None)
    times = {}
    if st.cfg.train.use_rollout_logprobs:
        if rollout_lp is None:
            raise DataError(f"rollout {rollout.rollout_id}", "--use-rollout-logprobs but some samples carry no "
                                                             "rollout_logprobs")
        old = dict(rollout_lp)
    elif not loss_type(st.loss_cfg.loss_type).reads_old_logprobs:
        # sft_loss: no ratio, KL, TIS or estimator term reads them (rl_settings refuses those with
        # it), so the forward pass that recomputes them is skipped; zeros keep the layout.
        old = {i: torch.zeros_like(masks[i]) for i in local}
    else:
        old = _forward_all(st.actor.model, rollout, plan, st, values=False)
    times["old_logprob"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    ref = _forward_all(st.ref, rollout, plan, st, values=False) if st.ref is not None else None
    times["ref_logprob"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    vals = _forward_all(st.critic.model, rollout, plan, st, values=True) if st.critic is not None else None
    times["values"] = time.perf_counter() - t2

    rewards = rewards_of(st, rollout)
    cfg = dataclasses.replace(st.adv_cfg, rewards_normalization=False)
    adv, ret = compute_advantages_and_returns(
        cfg, rewards=rewards[local], group_index=torch.tensor([samples[i].group_index for i in local]),
        loss_masks=[masks[i] for i in local],
        log_probs=[old[i] for i in local], ref_log_probs=[ref[i] for i in local] if ref is not None else None,
        values=[vals[i] for i in local] if vals is not None else None,
        whiten_group=st.par.dp_group if st.par.dp > 1 else None,
    )
    return Prepared(plan=plan, masks=masks, old_logprobs=old, advantages=dict(zip(local, adv)),
                    returns=dict(zip(local, ret)), ref_logprobs=ref, values=vals, rollout_logprobs=rollout_lp,
                    times=times)


def _global_denominator(st: TrainerSetup, prep: Prepared, step: list[list[int]]) -> Tensor:
    # `step` holds the real micro-batches only: a filler repeats a sample and must not count twice.
    masks = [prep.masks[i] for mb in step for i in mb]
    d = local_denominator(masks, st.loss_cfg.loss_reduction) if masks else torch.zeros((), device=st.device)
    d = d.to(st.device).float()
    if st.par.dp > 1:
        dist.all_reduce(d, group=st.par.dp_group)
    return d


def actor_metric_keys(st: TrainerSetup, prep: Prepared) -> list[str]:
    return actor_loss.metric_keys(st.loss_cfg, have_ref=st.ref is not None,
                                  have_rollout_logprobs=prep.rollout_logprobs is not None)


def _actor_loss(st: TrainerSetup, prep: Prepared, denom: Tensor) -> pipeline.LossFn:
    fn = actor_loss.loss_function(st.loss_cfg)

    def loss_fn(logits: Tensor, mb: MicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
        x = lp.prepare_logits(logits, st.vocab_size, st.cfg.rollout.rollout_temperature)
        cp = lp.cp_slice(mb)  # context parallelism: x covers this rank's columns; the results full rows
        if st.loss_cfg.entropy_coef > 0.0:
            ent = lp.vocab_parallel_entropy(x, cp)  # before the cross entropy, which shifts x in place
        else:
            with torch.no_grad():
                ent = lp.vocab_parallel_entropy(x.detach(), cp)
        logp = lp.token_logprobs(x, mb.tokens, cp)
        idx = mb.indices
        return fn(actor_loss.LossInputs(
            cfg=st.loss_cfg,
            log_probs=lp.response_slices(logp, mb),
            entropy=lp.response_slices(ent, mb),
            loss_masks=_masks(prep, mb),
            advantages=[prep.advantages[i] for i in idx],
            returns=[prep.returns[i] for i in idx],
            old_log_probs=[prep.old_logprobs[i] for i in idx],
            ref_log_probs=[prep.ref_logprobs[i] for i in idx] if prep.ref_logprobs is not None else None,
            rollout_log_probs=[prep.rollout_logprobs[i] for i in idx] if prep.rollout_logprobs is not None else None,
            global_denominator=denom,
        ))
    return loss_fn


def _critic_loss(st: TrainerSetup, prep: Prepared, denom: Tensor) -> pipeline.LossFn:
    assert st.critic is not None and prep.values is not None
    values = prep.values

    def loss_fn(out: Tensor, mb: MicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
        idx = mb.indices
        return compute_value_loss(
            values=lp.values_of(out, mb), old_values=[values[i] for i in idx], returns=[prep.returns[i] for i in idx],
            loss_masks=_masks(prep, mb), value_clip=st.cfg.train.value_clip,
            loss_reduction=st.loss_cfg.loss_reduction, global_denominator=denom,
        )
    return loss_fn


def _train_microbatches(st: TrainerSetup, tr: Trained, mbs: list[MicroBatch], loss_fn: pipeline.LossFn
                        ) -> dict[str, Tensor]:
    """Zero, forward + backward every micro-batch; the summed metrics (last stage; {} elsewhere)."""
    _zero(tr)
    sums: dict[str, Tensor] = {}
    # DDP averages over DP x CP (get_data_parallel_group(with_context_parallel=True)); every CP rank
    # computes the whole loss, its backward reaches its own tokens only (models/context_parallel.py)
    for m in pipeline.run_microbatches(tr.model, mbs, loss_fn, forward_only=False, grad_scale=st.par.dp * st.par.cp):
        for key, v in m.items():
            sums[key] = sums[key] + v if key in sums else v
    return sums


def _optimizer_step(tr: Trained) -> tuple[float, bool]:
    # Not just DDP's finish_grad_sync: qk-layernorm weights are shared by the heads of every TP
    # rank, so their gradients must also be summed over TP (and tied embeddings over PP).
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads([tr.model])
    tr.before_step()
    ok, grad_norm, _ = tr.optimizer.step()
    tr.scheduler.step(increment=1)
    return float(grad_norm) if grad_norm is not None else float("nan"), bool(ok)


def _zero(tr: Trained) -> None:
    tr.model.zero_grad_buffer()
    tr.optimizer.zero_grad()


def _reduce(st: TrainerSetup, sums: dict[str, Tensor], keys: list[str]) -> dict[str, float]:
    """Metric sums of the last stage's micro-batches -> global values on every rank."""
    zero = torch.zeros((), dtype=torch.float64, device=st.device)
    t = torch.stack([sums.get(k, zero).to(device=st.device, dtype=torch.float64) for k in keys])
    if st.par.dp > 1:
        dist.all_reduce(t, group=st.par.dp_group)
    pipeline.from_last_stage(t)
    return dict(zip(keys, t.tolist()))


def train_step(st: TrainerSetup, rollout: Rollout, prep: Prepared, k: int) -> dict[str, float]:
    """Optimizer step k of this rollout (actor, and the critic for PPO). Returns reduced metrics."""
    step = prep.plan.steps[k]
    denom = _global_denominator(st, prep, step)
    samples = rollout.samples
    out: dict[str, float] = {}
    tokens = sum(len(samples[i].prompt_tokens) + samples[i].response_length for mb in step for i in mb)
    out["lr"] = st.actor.optimizer.param_groups[0]["lr"]  # the LR this step uses (the scheduler moves it after)
    if st.critic is not None:
        out["critic_lr"] = st.critic.optimizer.param_groups[0]["lr"]
    mbs = step_microbatches(rollout, prep.plan, k, st.device, pipeline.seq_multiple(st.actor.model), _packed(st),
                            pipeline.segment_multiple(st.actor.model))
    t0 = time.perf_counter()
    if st.critic is not None:
        sums = _train_microbatches(st, st.critic, mbs, _critic_loss(st, prep, denom))
        gn, _ = _optimizer_step(st.critic)
        out.update(_reduce(st, sums, ["value_loss", "value_clipfrac"]))
        out["critic_grad_norm"] = gn
    t1 = time.perf_counter()
    if actor_trains(st.adv_cfg, rollout.rollout_id):
        keys = actor_metric_keys(st, prep)
        sums = _train_microbatches(st, st.actor, mbs, _actor_loss(st, prep, denom))
        gn, ok = _optimizer_step(st.actor)
        out.update(_reduce(st, sums, keys))
        out["grad_norm"] = gn
        out["update_successful"] = float(ok)
    t2 = time.perf_counter()
    ntok = torch.tensor([float(tokens)], dtype=torch.float64, device=st.device)
    if st.par.dp > 1:
        dist.all_reduce(ntok, group=st.par.dp_group)
    out["tokens"] = float(ntok.item())
    out["time/critic_step"] = t1 - t0
    out["time/actor_step"] = t2 - t1
    out["tokens_per_s"] = out["tokens"] / max(t2 - t0, 1e-9)
    out["num_microbatches"] = float(len(mbs))  # fillers included: the same on every DP rank
    return out


def rollout_metrics(rollout: Rollout, rewards: list[float]) -> dict[str, float]:
    """Data-side metrics of a rollout (the same on every rank)."""
    s = rollout.samples
    n = len(s)
    r = torch.tensor(rewards, dtype=torch.float64)
    lens = torch.tensor([x.response_length for x in s], dtype=torch.float64)
    return {
        "reward_mean": float(r.mean()),
        "reward_std": float(r.std(unbiased=False)) if n > 1 else 0.0,
        "response_length_mean": float(lens.mean()),
        "response_length_max": float(lens.max()),
        "truncation_rate": sum(x.status == SampleStatus.TRUNCATED for x in s) / n,
        "n_samples": float(n),
        "weight_version_min": float(min(x.weight_version for x in s)),
        # the driver's generation rate, from the rollout's metadata: the per-step line shows it beside
        # the trainer's own (rlslurm/step_line.py)
        **({GEN_TOK_S: float(rollout.meta.metrics[GEN_TOK_S])} if GEN_TOK_S in rollout.meta.metrics else {}),
    }
