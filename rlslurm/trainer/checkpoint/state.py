"""What a checkpoint holds, in megatron's `dist_checkpointing` terms: actor model + optimizer
(+ critic), LR schedules, every rank's RNG states, and the TrainerProgress (last trained rollout id,
weight version). Exactly-once training comes from keeping the progress in the same checkpoint as
the weights (buffer/progress.py). `load` restores all of it into the built trainer;
`load_model_weights` reads initial weights only (--load).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rlslurm.buffer.progress import TrainerProgress
from rlslurm.errors import DataError
from rlslurm.trainer.checkpoint.directory import LATEST, META, find_resume, iteration_of, warn
from rlslurm.trainer.collectives import collective_device

# The distributed optimizer's default layout (`fully_sharded_model_space`) builds flattened-range
# shards that megatron-core >= 0.16's dist_checkpointing refuses ("ShardedTensor.flattened_range is
# not supported"); `dp_reshardable` is the layout megatron's own trainer saves by default. The
# plain (non-distributed) optimizers ignore it.
OPTIM_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def has_optimizer_state(opt) -> bool:
    """False before the first step (e.g. the actor during PPO's critic-only warm-up): such an
    optimizer is saved as absent, since megatron can only shard state that exists."""
    parts = getattr(opt, "chained_optimizers", None) or [opt]
    return any(len(getattr(p, "optimizer", p).state) > 0 for p in parts)


def optimizers_with_state(st) -> set[str]:
    """Collective: the roles ("actor", "critic") whose optimizer has state on any rank."""
    out = set()
    if has_optimizer_state(st.actor.optimizer):
        out.add("actor")
    if st.critic is not None and has_optimizer_state(st.critic.optimizer):
        out.add("critic")
    # Every rank must build the same state dict: agree on the union (all ranks step together).
    flags = torch.tensor([float("actor" in out), float("critic" in out)], device=collective_device())
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return {n for n, f in zip(("actor", "critic"), flags.tolist()) if f > 0}


def sharded_state(st, progress: TrainerProgress | None, *, loading: bool, with_rng: bool,
                  optimizers: set[str]) -> dict[str, Any]:
    """The state dict `dist_checkpointing` saves, or the template it loads into (`loading`)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    rank, world = dist.get_rank(), dist.get_world_size()
    model_sd = st.actor.inner.sharded_state_dict()
    state: dict[str, Any] = {
        "model": model_sd,
        "scheduler": st.actor.scheduler.state_dict(),
        "progress": progress.state_dict() if progress is not None else TrainerProgress().state_dict(),
    }
    if "actor" in optimizers:
        state["optimizer"] = st.actor.optimizer.sharded_state_dict(model_sd, is_loading=loading,
                                                                   metadata=OPTIM_METADATA)
    if with_rng:
        state["rng"] = ShardedObject("rlslurm_rng_state", rng_state(), (world,), (rank,), replica_id=0)
    if st.critic is not None:
        csd = st.critic.inner.sharded_state_dict(prefix="critic.")
        state["critic"] = csd
        if "critic" in optimizers:
            state["critic_optimizer"] = st.critic.optimizer.sharded_state_dict(csd, is_loading=loading,
                                                                               metadata=OPTIM_METADATA)
        state["critic_scheduler"] = st.critic.scheduler.state_dict()
    return state


def staging_estimate(st) -> int:
    """Bytes this rank stages per save (trainer/checkpoint/staging.py): each model's parameters as they
    are, and for each optimizer's own parameters (this rank's fp32 main parameters, a shard under the
    distributed optimizer) themselves and Adam's two moments, fp32. An estimate for reserving the
    staging area ahead; a save that needs more grows it."""
    total = 0
    for role in (st.actor, st.critic):
        if role is None:
            continue
        total += sum(p.numel() * p.element_size() for p in role.inner.parameters())
        for part in getattr(role.optimizer, "chained_optimizers", None) or [role.optimizer]:
            inner = getattr(part, "optimizer", part)
            total += sum(3 * 4 * p.numel() for g in getattr(inner, "param_groups", []) for p in g["params"])
    return total


# ------------------------------------------------------------------------------ loading


def _materialize_state(opt) -> None:
    """A fresh distributed optimizer has no Adam state, and megatron (without TE/Apex) cannot build
    the sharded template to load into (`assert len(steps) == 1` in its state_dict). Megatron's own
    trainer first takes one zero-gradient step; the dummy values (and the parameters it touched)
    are then overwritten by the checkpoint."""
    for part in getattr(opt, "chained_optimizers", None) or [opt]:
        if hasattr(part, "_init_optimizer_states_with_dummy_values") and not has_optimizer_state(part):
            part._init_optimizer_states_with_dummy_values()


def _restore_steps(opt) -> None:
    """Give every parameter its own, correct Adam `step` after a load.

    megatron's distributed optimizer without TE/Apex (torch Adam) keeps the step count in each
    parameter's state but checkpoints it once, in the param_groups. Its `load_state_dict` then
    restores it wrongly twice over: it puts ONE tensor in every parameter's state (torch increments
    it in place per parameter, so the bias correction would run ahead), and the `dp_reshardable`
    loader afterwards copies the load template's step over it — the value of the dummy step taken
    by `_materialize_state` (1), not the checkpoint's. The param_groups' `step` is the
    checkpoint's value: rebuild every parameter's step from it. Other optimizers checkpoint the
    step per parameter and only need the sharing undone."""
    for part in getattr(opt, "chained_optimizers", None) or [opt]:
        inner = getattr(part, "optimizer", part)
        for group in inner.param_groups:
            for p in group["params"]:
                st = inner.state.get(p)
                if not st or not isinstance(st.get("step"), torch.Tensor):
                    continue
                if _is_distributed(part) and "step" in group:
                    st["step"] = torch.tensor(float(group["step"]), dtype=st["step"].dtype, device=st["step"].device)
                else:
                    st["step"] = st["step"].clone()


def _is_distributed(part) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(part, DistributedOptimizer)


def _load_optimizer(opt, state: dict[str, Any]) -> None:
    from rlslurm.trainer.adam_kernel import use_fused_adam

    with torch.no_grad():  # fp32 runs: the optimizer's main params are views of the model's leaves
        opt.load_state_dict(state)
    _restore_steps(opt)
    use_fused_adam(opt)  # the loaded param groups carry the saving run's kernel flags


def load(st, d: Path) -> TrainerProgress:
    """Collective: restore everything a save wrote into the built trainer."""
    from megatron.core import dist_checkpointing

    meta = json.loads((d / META).read_text())
    same_world = meta.get("world_size") == dist.get_world_size()
    if not same_world:
        warn(f"{d} was saved by {meta.get('world_size')} ranks, this job has {dist.get_world_size()}: "
             "RNG states are not restored (weights, optimizer and progress are)")
    optimizers = set(meta.get("optimizers", []))
    if "actor" in optimizers:
        _materialize_state(st.actor.optimizer)
    if "critic" in optimizers and st.critic is not None:
        _materialize_state(st.critic.optimizer)
    template = sharded_state(st, None, loading=True, with_rng=same_world, optimizers=optimizers)
    state = dist_checkpointing.load(template, str(d))
    st.actor.inner.load_state_dict(state["model"])
    if "actor" in optimizers:
        _load_optimizer(st.actor.optimizer, state["optimizer"])
    st.actor.scheduler.load_state_dict(state["scheduler"])
    if st.critic is not None:
        if "critic" not in state:
            raise DataError(str(d), "checkpoint has no critic but --advantage-estimator ppo needs one")
        st.critic.inner.load_state_dict({k.removeprefix("critic."): v for k, v in state["critic"].items()})
        if "critic" in optimizers:
            _load_optimizer(st.critic.optimizer, state["critic_optimizer"])
        st.critic.scheduler.load_state_dict(state["critic_scheduler"])
    if same_world:
        set_rng_state(state["rng"])
    return TrainerProgress.from_state_dict(state["progress"])


def load_model_weights(model: torch.nn.Module, path: Path) -> None:
    """Initial weights from a Megatron dist checkpoint: one of ours (a checkpoints root with
    `latest`, or an iter_ directory) or a plain model checkpoint (`rlslurm convert hf-to-mcore`)."""
    from megatron.core import dist_checkpointing

    d = Path(path)
    if (d / LATEST).exists() or any(iteration_of(p.name) is not None for p in d.iterdir() if p.is_dir()):
        found = find_resume(d)
        if found is None:
            raise DataError(str(d), "--load: no complete checkpoint in this directory")
        d = found
    if not (d / "metadata.json").exists():
        raise DataError(str(d), "--load: not a megatron distributed checkpoint (no metadata.json)")
    keyed = (d / META).exists()
    sd = model.sharded_state_dict()
    state = dist_checkpointing.load({"model": sd} if keyed else sd, str(d))
    model.load_state_dict(state["model"] if keyed else state)
