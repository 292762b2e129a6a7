"""Build everything het-group 0 trains with: torch.distributed, Megatron parallel state, seeds,
the actor (DDP + optimizer + LR schedule), the frozen reference and the PPO critic.

The order matters and is the same on every rank: process group -> CPU shim -> parallel state ->
seeds -> models (identical random init on every DP rank because the seed is) -> HF weights ->
DDP wrap -> optimizer -> scheduler. Resuming from a checkpoint happens after this (trainer/checkpoint/).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from rlslurm.errors import ConfigError
from rlslurm.models.model_from_hf import run_model
from rlslurm.settings.config import RunConfig
from rlslurm.settings.layout import context_parallel_refusal
from rlslurm.settings.model_config import ModelConfig
from rlslurm.settings.parallel_grid import check_expert_grid
from rlslurm.settings.rl_settings import check_rl_settings, estimator
from rlslurm.trainer.advantages import AdvantageConfig, rl_configs_from_train
from rlslurm.trainer.collectives import group_timeout
from rlslurm.trainer.losses import PolicyLossConfig

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------ distributed


def init_distributed(device: str, timeout_minutes: float) -> tuple[int, int]:
    """Join torchrun's process group: NCCL on GPUs, gloo on CPU, with an explicit timeout
    (trainer/collectives.py says why)."""
    # Device numbers in NVML's (PCI) order, as the rollout node reads its engines' GPUs through
    # nvidia-smi (docs/gpu.md, "Which GPU"); before CUDA reads it, at its first use below.
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    use_cuda = device == "cuda" and torch.cuda.is_available()
    if use_cuda:
        # Every rank of the weight-sync group must agree on NCCL's cuMem buffers, and SGLang sets
        # NCCL_CUMEM_ENABLE=0 in its engines unless the variable is set: a trainer left at NCCL's default
        # (1) made the engine fail with "Cuda failure 'invalid argument'" (transport/p2p.cc) and the
        # trainer hang (docs/gpu.md, tools/gpu/nccl_pair_check.py). Set before NCCL's first use.
        os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", timeout=group_timeout(timeout_minutes))
    return dist.get_rank(), dist.get_world_size()


@dataclass(frozen=True)
class Parallel:
    tp: int
    pp: int
    cp: int
    ep: int
    dp: int
    dp_rank: int
    tp_rank: int
    pp_rank: int = 0
    etp: int = 1  # the routed experts' tensor parallelism (rlslurm/settings/parallel_grid.py)

    @property
    def dp_group(self):
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group()

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def check_context_parallel(cfg: RunConfig, mc: ModelConfig | None = None) -> None:
    """What context parallelism (CP > 1, docs/context-parallel.md) cannot be combined with; one line
    each (resolve() refuses the same at submit: rlslurm/settings/layout.py context_parallel_refusal)."""
    why = context_parallel_refusal(cfg, mc)
    if why is not None:
        raise ConfigError(why)


def init_parallel(cfg: RunConfig, world: int) -> Parallel:
    """Megatron parallel state from the train section (CPU shim first when there is no GPU)."""
    t = cfg.train
    check_context_parallel(cfg)
    if t.pipeline_model_parallel_size < 1:
        raise ConfigError(f"--pipeline-model-parallel-size {t.pipeline_model_parallel_size}: must be >= 1")
    mp = t.tensor_model_parallel_size * t.pipeline_model_parallel_size * t.context_parallel_size
    if world % mp:
        raise ConfigError(
            f"--tensor-model-parallel-size {t.tensor_model_parallel_size} x --pipeline-model-parallel-size "
            f"{t.pipeline_model_parallel_size} x --context-parallel-size {t.context_parallel_size} = {mp} does not "
            f"divide the trainer world size {world}")
    check_expert_grid(world, tp=t.tensor_model_parallel_size, pp=t.pipeline_model_parallel_size,
                      ep=t.expert_model_parallel_size, etp=t.expert_tp, where=f"the trainer world size {world}")
    if not torch.cuda.is_available():
        from rlslurm.models import cpu_shim

        cpu_shim.apply()
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=t.tensor_model_parallel_size,
            pipeline_model_parallel_size=t.pipeline_model_parallel_size,
            context_parallel_size=t.context_parallel_size,
            expert_model_parallel_size=t.expert_model_parallel_size,
            expert_tensor_parallel_size=t.expert_tp,
            distributed_timeout_minutes=max(1, math.ceil(t.distributed_timeout_minutes)),
        )
    return Parallel(
        tp=t.tensor_model_parallel_size, pp=t.pipeline_model_parallel_size, cp=ps.get_context_parallel_world_size(),
        ep=t.expert_model_parallel_size,
        etp=t.expert_tp,
        dp=ps.get_data_parallel_world_size(), dp_rank=ps.get_data_parallel_rank(),
        tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
    )


def check_pipeline(mc: ModelConfig, tcfg, pp: int) -> None:
    """What the RL loop's pipeline path (megatron's 1F1B schedule, one model chunk) cannot do; the
    split of the layers over the stages (and the interleaved schedule) is checked where the
    TransformerConfig is made (rlslurm/settings/parallel_grid.py)."""
    if pp <= 1:
        return
    if getattr(tcfg, "overlap_p2p_comm", False):
        raise ConfigError("--megatron-overlap-p2p-comm: megatron's non-interleaved pipeline schedule, which "
                          "the RL trainer loop uses, refuses it")
    if getattr(tcfg, "mtp_num_layers", None):
        raise ConfigError("--megatron-mtp-num-layers: multi-token prediction with pipeline parallelism is not "
                          "supported by the RL trainer loop")


def set_seeds(seed: int) -> None:
    """Same seed on every DP rank (identical random init); megatron's tracker makes TP shards differ."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


# ------------------------------------------------------------------------------ configs


def split_megatron_overrides(overrides: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`--megatron-<field>` values -> (TransformerConfig fields, OptimizerConfig fields).

    A field of both goes to both (e.g. params_dtype); an unknown one is left in the transformer
    part, where `transformer_config` rejects it naming the flag.
    """
    from megatron.core.optimizer import OptimizerConfig

    opt_fields = {f.name for f in dataclasses.fields(OptimizerConfig)}
    from megatron.core.transformer import TransformerConfig

    tf_fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    tf, opt = {}, {}
    for k, v in overrides.items():
        if k in opt_fields:
            opt[k] = v
        if k in tf_fields or k not in opt_fields:
            tf[k] = v
    return tf, opt


def params_dtype(cfg: RunConfig) -> torch.dtype:
    return torch.bfloat16 if cfg.train.bf16 else torch.float32


# ------------------------------------------------------------------------------ models


class ValueHead(torch.nn.Module):
    """The critic's output layer: hidden -> one value per token, in place of the LM head.

    It takes the LM head's call signature (GPTModel calls `output_layer(h, weight=..., ...)`)
    and is replicated over TP: without sequence parallelism every TP rank holds the full hidden
    states, so every TP rank computes the same values and the same gradients.
    """

    def __init__(self, hidden: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device))

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None, **_: Any):
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {},
                                                   sharded_offsets)


@dataclass
class Trained:
    """A model that trains: DDP-wrapped module, its optimizer and its LR schedule."""

    model: Any            # megatron DistributedDataParallel
    optimizer: Any        # MegatronOptimizer
    scheduler: Any        # OptimizerParamScheduler
    # what must finish before the optimizer steps: under --colocate, its state's copy back to the GPU
    # (trainer/colocate.py finish_onload)
    before_step: Callable[[], None] = lambda: None

    @property
    def inner(self) -> torch.nn.Module:
        from rlslurm.convert.parallel import unwrap

        return unwrap(self.model)


@dataclass
class TrainerSetup:
    cfg: RunConfig
    mc: ModelConfig
    tcfg: Any
    par: Parallel
    adv_cfg: AdvantageConfig
    loss_cfg: PolicyLossConfig
    actor: Trained
    ref: torch.nn.Module | None
    critic: Trained | None
    vocab_size: int
    vocab_size_padded: int
    device: torch.device


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _build(mc: ModelConfig, tcfg, vocab_padded: int, device: torch.device, par: Parallel,
           share_embeddings: bool | None = None, packed: bool = False) -> torch.nn.Module:
    """This pipeline stage's part of the model (megatron picks the stage's layers and offsets)."""
    from rlslurm.models.build import build_gpt_model

    model = build_gpt_model(mc, tcfg, vocab_size_padded=vocab_padded, pre_process=par.first_stage,
                            post_process=par.last_stage, share_embeddings=share_embeddings, packed=packed)
    return model.to(device)


def _init_weights(model: torch.nn.Module, mc: ModelConfig, cfg: RunConfig, what: str) -> None:
    """HF safetensors (config.json checked) or a Megatron dist checkpoint (`--load` of another run /
    `rlslurm convert`); with neither the model keeps its seeded random init."""
    from rlslurm.convert import load_hf_checkpoint

    load = cfg.model.load
    if load is not None and what == "actor" and Path(load).resolve() != Path(cfg.run_dir, "checkpoints").resolve():
        from rlslurm.trainer.checkpoint import load_model_weights

        load_model_weights(model, Path(load))
        return
    if cfg.model.hf_checkpoint is not None:
        load_hf_checkpoint(model, mc, cfg.model.hf_checkpoint)


def _wrap(model: torch.nn.Module, tcfg, cfg: RunConfig) -> torch.nn.Module:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    if tcfg.bf16 or tcfg.fp16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(tcfg, model)
    ddp = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=cfg.train.use_distributed_optimizer,
    )
    return DistributedDataParallel(config=tcfg, ddp_config=ddp, module=model)


def _optimizer(model, tcfg, cfg: RunConfig, lr: float, overrides: dict[str, Any]) -> tuple[Any, Any]:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from rlslurm.trainer.adam_kernel import use_fused_adam

    t = cfg.train
    kw: dict[str, Any] = dict(
        optimizer="adam", lr=lr, min_lr=t.min_lr, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2, adam_eps=t.adam_eps, clip_grad=t.clip_grad, bf16=tcfg.bf16, fp16=tcfg.fp16,
        params_dtype=tcfg.params_dtype, use_distributed_optimizer=t.use_distributed_optimizer,
    )
    kw.update(overrides)
    try:
        ocfg = OptimizerConfig(**kw)
    except (TypeError, ValueError, AssertionError) as e:
        raise ConfigError(f"--megatron-*: megatron-core rejected the OptimizerConfig: {e}") from None
    opt = get_megatron_optimizer(ocfg, [model])
    if use_fused_adam(opt) and (not dist.is_initialized() or dist.get_rank() == 0):
        log.info("optimizer: torch's fused AdamW kernel (megatron-core found neither transformer-engine's nor "
                 "Apex's FusedAdam; torch's default step needs a scratch copy of the fp32 main params: "
                 "rlslurm/trainer/adam_kernel.py)")
    if ocfg.optimizer_cpu_offload:
        from rlslurm.trainer.hybrid_offload import make_loadable

        make_loadable(opt)
    total = max(1, cfg.rollout.num_rollout * t.num_steps_per_rollout)
    sched = OptimizerParamScheduler(
        opt, init_lr=0.0 if t.lr_warmup_iters else lr, max_lr=lr, min_lr=t.min_lr,
        lr_warmup_steps=t.lr_warmup_iters, lr_decay_steps=max(total, t.lr_warmup_iters + 1),
        lr_decay_style=t.lr_decay_style, start_wd=t.weight_decay, end_wd=t.weight_decay,
        wd_incr_steps=total, wd_incr_style="constant",
    )
    return opt, sched


def needs_ref(adv: AdvantageConfig, loss: PolicyLossConfig) -> bool:
    return loss.kl_loss_coef > 0.0 or adv.kl_coef > 0.0


def build_trainer(cfg: RunConfig, world: int) -> TrainerSetup:
    """Everything but the resume: parallel state, seeds, actor (+ref, +critic), optimizers."""
    check_rl_settings(cfg.train, cfg.model)  # as resolve() did at submit, with the reference-model rule
    adv_cfg, loss_cfg = rl_configs_from_train(cfg.train)
    par = init_parallel(cfg, world)
    set_seeds(cfg.run.seed)
    mc = run_model(cfg.model.model, cfg.model.hf_checkpoint)  # --model, or --hf-checkpoint's config.json
    check_context_parallel(cfg, mc)
    from rlslurm.models.build import padded_vocab_size, transformer_config

    tf_over, opt_over = split_megatron_overrides(cfg.megatron)
    tcfg = transformer_config(mc, params_dtype=params_dtype(cfg), tp=par.tp, pp=par.pp, ep=par.ep, etp=par.etp,
                              cp=par.cp, first_stage_layers=cfg.train.decoder_first_pipeline_num_layers,
                              last_stage_layers=cfg.train.decoder_last_pipeline_num_layers, overrides=tf_over,
                              transformer_impl=cfg.train.transformer_impl)
    check_pipeline(mc, tcfg, par.pp)
    vpad = padded_vocab_size(mc.arch.vocab_size, par.tp)
    device = _device()

    with_ref = needs_ref(adv_cfg, loss_cfg)

    packed = cfg.train.qkv_format == "thd"
    actor_model = _build(mc, tcfg, vpad, device, par, packed=packed)
    _init_weights(actor_model, mc, cfg, "actor")
    actor_ddp = _wrap(actor_model, tcfg, cfg)
    opt, sched = _optimizer(actor_ddp, tcfg, cfg, cfg.train.lr, opt_over)
    actor = Trained(actor_ddp, opt, sched)

    ref = None
    if with_ref:
        from rlslurm.convert import load_hf_checkpoint

        ref = _build(mc, tcfg, vpad, device, par, packed=packed)
        load_hf_checkpoint(ref, mc, cfg.model.ref_load or cfg.model.hf_checkpoint)
        ref.eval().requires_grad_(False)

    critic = None
    if estimator(adv_cfg.estimator).critic:  # PPO
        # slime initialises the critic's trunk from the actor's checkpoint; the value head starts at 0
        # so the first advantages are the plain returns.
        # Untied on every stage: its output layer becomes the value head, so there is no LM head
        # to keep equal to the embedding (with PP > 1 a tie would also all-reduce the embedding's
        # gradient with the value head's across stages).
        cm = _build(mc, tcfg, vpad, device, par, share_embeddings=False, packed=packed)
        _init_weights(cm, mc, cfg, "critic")
        if par.last_stage:
            cm.output_layer = ValueHead(mc.arch.hidden_size, tcfg.params_dtype, device)
        cddp = _wrap(cm, tcfg, cfg)
        copt, csched = _optimizer(cddp, tcfg, cfg, cfg.train.critic_lr or cfg.train.lr, opt_over)
        critic = Trained(cddp, copt, csched)

    return TrainerSetup(cfg=cfg, mc=mc, tcfg=tcfg, par=par, adv_cfg=adv_cfg, loss_cfg=loss_cfg, actor=actor, ref=ref,
                        critic=critic, vocab_size=mc.arch.vocab_size, vocab_size_padded=vpad, device=device)
