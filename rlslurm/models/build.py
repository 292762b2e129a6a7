"""Build the actor's megatron-core `GPTModel` from a model config.

- `transformer_config(mc, ...)` turns the architecture numbers of `rlslurm.settings.model_config.Arch`
  into a `TransformerConfig` (an `MLATransformerConfig` for MLA models) plus the user's
  `--megatron-<field>` overrides.
- `build_gpt_model(mc, tcfg, ...)` builds the model with megatron's local layer spec, or
  transformer-engine's with `--transformer-impl transformer_engine` (tcfg.transformer_impl; never
  because transformer-engine imports: rlslurm/settings/transformer_impl.py), plus small spec extensions:
  GLM-4's sandwich norms (`post_self_attn_layernorm`, `post_mlp_layernorm`), MiniMax-M2's q/k norm
  over all heads (models/qk_norm.py), Qwen3-Next/Qwen3.5's gated delta net layers and zero-centred
  norms (models/gated_delta.py), GLM-5's sparse attention (megatron's DSA with rlslurm's indexer,
  models/dsa.py) and, for MLA without transformer-engine, an SDPA core attention (megatron's local
  one does not take MLA's `k_channels`/`v_channels`).
- `padded_vocab_size(vocab, tp)`: Megatron shards the vocabulary over TP, so the embedding is
  padded to a multiple of `divisible_by * tp`; `rlslurm.convert` pads on import and trims on export.

Works with megatron-core 0.16.x (CPU, Python 3.11) and 0.19.x (GPU): keyword arguments that one
version lacks are dropped by checking the dataclass fields / signatures rather than the version; the
other differences it relies on are in docs/megatron-versions.md.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F

from rlslurm.errors import ConfigError
from rlslurm.models.attention_ops import repeat_kv_heads, varlen_attn, varlen_causal
from rlslurm.settings.model_config import ModelConfig
from rlslurm.settings.parallel_grid import (
    check_gated_delta_net,
    check_pipeline_split,
    owned_field_refusal,
    stage_layers,
)
from rlslurm.settings.transformer_impl import LOCAL, TE, te_refusal


def uses_te(tcfg) -> bool:
    """Whether `tcfg` asks for transformer-engine's layers (--transformer-impl, never TE's importability:
    rlslurm/settings/transformer_impl.py)."""
    return getattr(tcfg, "transformer_impl", LOCAL) == TE


# Settings that the CPU/local path cannot do, or fusions that do not change the math
# (docs/megatron-cpu.md, "What the CPU path cannot do"); the user may still override them with
# --transformer-impl transformer_engine.
_SAFE_DEFAULTS: dict[str, Any] = {
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
    "apply_rope_fusion": False,
    "persist_layer_norm": False,
    "gradient_accumulation_fusion": False,
    "bias_activation_fusion": False,
    "masked_softmax_fusion": False,
    "bias_dropout_fusion": False,
    "use_cpu_initialization": True,
}


def padded_vocab_size(vocab: int, tp: int, divisible_by: int = 128) -> int:
    """Vocabulary size rounded up so that every TP rank holds an equal, aligned slice."""
    if vocab <= 0 or tp <= 0 or divisible_by <= 0:
        raise ConfigError(f"padded_vocab_size: vocab={vocab}, tp={tp}, divisible_by={divisible_by} must be > 0")
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int, *, tp_rank: int | None = None) -> torch.Tensor:
    """Logits of the TP-padding rows -> -inf, so softmax / log-probs equal HF's over the true vocab.

    The padding rows of the output layer are zeros (rlslurm.convert pads with zeros), so their
    logits are 0, not absent: left in, they add `exp(0)` terms to every softmax denominator.
    `logits` is this rank's vocab-parallel slice `[..., vocab_padded / tp]` (tp_rank defaults to
    megatron's current TP rank). Returns a new tensor; differentiable.
    """
    if tp_rank is None:
        from megatron.core import parallel_state as ps

        tp_rank = ps.get_tensor_model_parallel_rank() if ps.model_parallel_is_initialized() else 0
    part = logits.shape[-1]
    start = tp_rank * part
    if start + part <= vocab_size:
        return logits
    ids = torch.arange(start, start + part, device=logits.device)
    return logits.masked_fill(ids >= vocab_size, float("-inf"))


def _config_classes() -> tuple[type, type]:
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    return TransformerConfig, MLATransformerConfig


def _arch_kwargs(mc: ModelConfig, *, te: bool = False) -> dict[str, Any]:
    """TransformerConfig fields that follow from the architecture (the numbers that change the math)."""
    a = mc.arch
    kw: dict[str, Any] = dict(
        num_layers=a.num_layers,
        hidden_size=a.hidden_size,
        ffn_hidden_size=a.ffn_hidden_size,
        num_attention_heads=a.num_attention_heads,
        num_query_groups=a.num_query_groups,
        kv_channels=a.kv_channels,
        layernorm_epsilon=a.norm_epsilon,
        normalization=a.normalization,
        add_bias_linear=a.add_bias_linear,
        add_qkv_bias=a.add_qkv_bias,
        # MiniMax-M2's all-heads q/k norm is rlslurm's module (layer_specs), not megatron's per-head
        # one; with qk_layernorm off finalize_model_grads does not sum its TP-sharded weight's
        # gradient over TP as it does a replicated per-head norm's (models/qk_norm.py)
        qk_layernorm=a.qk_layernorm and not a.qk_layernorm_all_heads,
        rotary_interleaved=a.rotary_interleaved,
        # Qwen3-Next: norms stored as offsets from 1 (the local spec's TorchNorm builds them, megatron's
        # own local norm refuses the setting) and the gated full attention
        layernorm_zero_centered_gamma=a.norm_zero_centered,
        attention_output_gate=a.attention_output_gate,
        # Megatron's attention softmax runs in the input dtype unless told otherwise; HF runs it in
        # fp32 too, so keep it fp32 for bf16 parity.
        attention_softmax_in_fp32=True,
    )
    if a.activation == "swiglu":
        kw.update(gated_linear_unit=True, activation_func=F.silu)
    else:
        kw.update(gated_linear_unit=False, activation_func=F.gelu)
    if a.moe:
        m = a.moe
        kw.update(
            num_moe_experts=m.num_experts,
            moe_router_topk=m.router_topk,
            moe_ffn_hidden_size=m.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=m.shared_expert_ffn_hidden_size or None,
            moe_layer_freq=[0] * m.first_k_dense + [1] * (a.num_layers - m.first_k_dense),
            moe_router_score_function=m.router_score_function,
            # softmax: renormalising the top-k probabilities (HF norm_topk_prob) equals a softmax
            # over the top-k logits, which is Megatron's pre_softmax=False. Sigmoid always renormalises.
            moe_router_pre_softmax=(m.router_score_function == "softmax" and not m.router_topk_norm),
            moe_router_topk_scaling_factor=(m.router_scaling_factor if m.router_scaling_factor != 1.0 else None),
            moe_router_enable_expert_bias=m.router_expert_bias,
            # The correction bias is the checkpoint's (HF e_score_correction_bias): RL keeps it, as
            # slime's GLM-4.5 recipes do; megatron's default nudges it by 1e-3 every step
            # (docs/model-families.md, "Router correction bias").
            moe_router_bias_update_rate=0.0,
            moe_router_num_groups=(m.router_num_groups if m.router_num_groups > 1 else None),
            moe_router_group_topk=(m.router_group_topk if m.router_num_groups > 1 else None),
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,  # the legacy GroupedMLP needs the CUDA grouped_gemm package
            moe_token_dispatcher_type="alltoall" if te else "allgather",
            moe_router_dtype="fp32",
            moe_shared_expert_overlap=False,
            moe_shared_expert_gate=m.shared_expert_gate,
        )
        if m.router_score_function == "sigmoid" and not m.router_topk_norm:
            raise ConfigError(
                f"model config {mc.name}: arch.moe.router_topk_norm=false with sigmoid scores is not "
                "supported by megatron-core (it always renormalises sigmoid top-k)"
            )
    if a.gated_delta_net:
        d = a.gated_delta_net
        # Qwen3-Next's linear-attention layers: megatron-core's GatedDeltaNet with rlslurm's kernels,
        # placed by rlslurm's layer spec (layer_specs; megatron's own hybrid spec builder needs
        # transformer-engine). Same int rule as HF's full_attention_interval.
        # (transformer_config unsets experimental_attention_variant at CP > 1: megatron asserts CP 1 with it)
        kw.update(experimental_attention_variant="gated_delta_net", linear_attention_freq=d.full_attention_interval,
                  linear_conv_kernel_dim=d.conv_kernel_dim, linear_key_head_dim=d.key_head_dim,
                  linear_value_head_dim=d.value_head_dim, linear_num_key_heads=d.num_key_heads,
                  linear_num_value_heads=d.num_value_heads)
    if a.mla:
        m2 = a.mla
        kw.update(
            multi_latent_attention=True,
            q_lora_rank=m2.q_lora_rank,
            kv_lora_rank=m2.kv_lora_rank,
            qk_head_dim=m2.qk_head_dim,
            qk_pos_emb_head_dim=m2.qk_pos_emb_head_dim,
            v_head_dim=m2.v_head_dim,
            rotary_base=a.rotary_base,
            rotary_percent=a.rotary_percent,
        )
        rs = a.rope_scaling
        if rs is None:
            kw.update(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
        elif rs.type == "yarn":
            kw.update(
                rope_type="yarn",
                rotary_scaling_factor=rs.factor,
                original_max_position_embeddings=rs.original_max_position_embeddings,
                beta_fast=rs.beta_fast if rs.beta_fast is not None else 32.0,
                beta_slow=rs.beta_slow if rs.beta_slow is not None else 1.0,
                mscale=rs.mscale if rs.mscale is not None else 1.0,
                mscale_all_dim=rs.mscale_all_dim if rs.mscale_all_dim is not None else 0.0,
            )
        else:
            raise ConfigError(f"model config {mc.name}: arch.rope_scaling.type={rs.type!r} is not supported with MLA")
        if a.dsa is not None:
            # GLM-5: megatron-core's DSA core attention with rlslurm's indexer (models/dsa.py); the
            # indexer's KL loss off (refused in transformer_config: the indexer is not trained)
            kw.update(experimental_attention_variant="dsa", dsa_indexer_n_heads=a.dsa.index_n_heads,
                      dsa_indexer_head_dim=a.dsa.index_head_dim, dsa_indexer_topk=a.dsa.index_topk,
                      dsa_indexer_loss_coeff=0.0)
    elif a.rope_scaling is not None:
        rs = a.rope_scaling
        # Megatron's llama3 rope scaling hard-codes low/high freq factors 1/4 and original 8192.
        if rs.type != "llama3" or (rs.low_freq_factor, rs.high_freq_factor, rs.original_max_position_embeddings) not in (
            (1.0, 4.0, 8192), (None, None, 8192)
        ):
            raise ConfigError(
                f"model config {mc.name}: arch.rope_scaling {rs.model_dump(exclude_none=True)} is not supported "
                "for non-MLA models (only llama3 with low_freq_factor=1, high_freq_factor=4, "
                "original_max_position_embeddings=8192)"
            )
    return kw


def transformer_config(
    mc: ModelConfig,
    *,
    params_dtype: torch.dtype = torch.float32,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    cp: int = 1,
    etp: int | None = None,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    overrides: dict[str, Any] | None = None,
    transformer_impl: str = LOCAL,
):
    """The TransformerConfig (MLATransformerConfig for MLA) of `mc` at the given parallel sizes.

    `overrides` are the user's `--megatron-<field>` values by TransformerConfig field name; they
    win over everything computed here, but for the parallel sizes (rlslurm/settings/parallel_grid.py: the
    process groups are built from rlslurm's own flags). An unknown field is a ConfigError naming the
    flag. `etp`: the routed experts' tensor parallel size (None: TP, megatron's default).
    `first_stage_layers`/`last_stage_layers`: the first/last pipeline stage's layers (None: an even
    split), checked by megatron-core's rule (rlslurm/settings/parallel_grid.py stage_layers) before megatron's
    own asserts could fire mid-build. `transformer_impl`: --transformer-impl (megatron-core's field of the
    same name; refused in one line where transformer-engine cannot run, settings/transformer_impl.py).
    """
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if (why := te_refusal(transformer_impl, device=device, import_it=True)) is not None:
        raise ConfigError(why)
    te = transformer_impl == TE
    TransformerConfig, MLATransformerConfig = _config_classes()
    cls = MLATransformerConfig if mc.arch.mla else TransformerConfig
    fields = {f.name for f in dataclasses.fields(cls)}
    for key in overrides or {}:
        if (why := owned_field_refusal(key)) is not None:
            raise ConfigError(why)
        if key not in fields:
            raise ConfigError(
                f"--megatron-{key.replace('_', '-')}: {key!r} is not a megatron-core {cls.__name__} field"
            )
    stage_layers(mc.arch.num_layers, pp, first_stage_layers, last_stage_layers, model=mc.name)
    check_all_heads_qk_norm(mc, tp)
    check_gated_delta_net(mc.arch, mc.name, tp=tp)
    check_pipeline_split(overrides or {}, pp)
    if params_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ConfigError(f"params_dtype={params_dtype}: expected float32, bfloat16 or float16")
    etp = tp if etp is None else etp
    kw: dict[str, Any] = dict(_SAFE_DEFAULTS)
    kw.update(_arch_kwargs(mc, te=te))
    kw.update(
        transformer_impl=transformer_impl,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        num_layers_in_first_pipeline_stage=first_stage_layers,
        num_layers_in_last_pipeline_stage=last_stage_layers,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        context_parallel_size=cp,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        pipeline_dtype=params_dtype,
    )
    if not te:
        kw["use_cpu_initialization"] = device == "cpu"
    # megatron trains MoE with TP > 1 only under sequence parallelism (moe_layer.py:379); with
    # it, sequence lengths must be divisible by TP.
    # MLA's TP > 1 backward is only right under sequence parallelism (see _local_spec_fixes).
    # Gated delta nets: their output norm sees only this rank's value heads, so its weight gradient is
    # partial per rank; as a sequence-parallel parameter finalize_model_grads sums it over TP
    # (models/gated_delta.py GatedOutputNorm).
    kw["sequence_parallel"] = tp > 1 and (mc.arch.moe is not None or mc.arch.mla is not None
                                          or mc.arch.gated_delta_net is not None)
    # RL micro-batches are right-padded to their own longest sample and dynamic batching varies
    # their sample count, so pipeline stages must exchange each activation's shape before it
    # (megatron's schedule otherwise assumes one fixed [seq, micro_batch, hidden] per call).
    kw["variable_seq_lengths"] = pp > 1
    # the experts' ETP x EP group holds ranks of different DP index unless ETP x EP divides TP (it
    # then lies within a dense TP group, rlslurm/settings/parallel_grid.py); EP > 1 takes alltoall either way
    mixes_dp = ep > 1 or tp % etp != 0
    if pp > 1 or mixes_dp:
        # The allgather token dispatcher gathers equal-sized chunks from the ETP x EP ranks, but at
        # EP > 1 those ranks belong to different DP ranks, whose micro-batches have different
        # shapes (measured on gloo: "Received data size doesn't match expected size", abort);
        # megatron also refuses it under variable_seq_lengths (its default even for dense models,
        # where it is never used). The alltoall one exchanges token counts first, and gives the
        # same outputs (docs/megatron-cpu.md, "MoE token dispatcher and its side stream"; the CPU
        # shim fakes that side stream).
        kw["moe_token_dispatcher_type"] = "alltoall"
    # 0.16 calls it original_max_position_embeddings, later versions may rename: keep what exists.
    if "original_max_position_embeddings" in kw and "original_max_position_embeddings" not in fields:
        if "max_position_embeddings" in fields:
            kw["max_position_embeddings"] = kw.pop("original_max_position_embeddings")
    if cp > 1 and kw.get("experimental_attention_variant") == "gated_delta_net":
        # megatron-core 0.16 asserts context_parallel_size 1 for its GatedDeltaNet forward; rlslurm's
        # subclass does CP itself (models/gated_delta.py context_parallel_gated_delta_net), and nothing
        # else reads the field (the layer spec is rlslurm's): left unset, the layer sizes stay
        kw["experimental_attention_variant"] = None
    kw.update(overrides or {})
    if mixes_dp and kw.get("moe_token_dispatcher_type") == "allgather":
        raise ConfigError(f"--megatron-moe-token-dispatcher-type allgather at --expert-model-parallel-size {ep} x "
                          f"--expert-tensor-parallel-size {etp}: "
                          "it needs equal micro-batch shapes on every expert-parallel rank, which right-padded "
                          "RL micro-batches of different DP ranks do not have (use alltoall)")
    if mc.arch.gated_delta_net is not None and tp > 1 and not kw.get("sequence_parallel"):
        raise ConfigError("--megatron-sequence-parallel: gated delta nets at TP > 1 need sequence parallelism (their "
                          "output norm's TP-partial gradient is summed as a sequence-parallel weight's, "
                          "models/gated_delta.py GatedOutputNorm)")
    if mc.arch.mla is not None and tp > 1 and not te and not kw.get("sequence_parallel"):
        raise ConfigError("--megatron-sequence-parallel: MLA at TP > 1 without transformer-engine needs "
                          "sequence parallelism (megatron-core's other MLA path has wrong TP gradients)")
    check_dsa(mc, kw)
    kw = {k: v for k, v in kw.items() if k in fields}
    # megatron-core 0.16 asserts CP 1 for DSA; rlslurm's GLM-5 attention does CP itself (models/dsa.py)
    variant = kw.pop("experimental_attention_variant") if kw.get("context_parallel_size", 1) > 1 and mc.arch.dsa \
        else None
    try:
        cfg = cls(**kw)
        if variant is not None:
            cfg.experimental_attention_variant = variant  # MLA then hands the core attention x and qr
        return cfg
    except (AssertionError, ValueError, TypeError) as e:
        raise ConfigError(f"model config {mc.name}: megatron-core rejected the TransformerConfig: {e}") from None


def check_all_heads_qk_norm(mc: ModelConfig, tp: int) -> None:
    """MiniMax-M2's all-heads q/k norm is split over TP by whole heads (models/qk_norm.py). megatron-core
    0.16 runs TP above the KV heads by giving several ranks the same KV head (attention.py:1464-1475),
    where the k norm's sum of squares over TP would count that head more than once: refused."""
    a = mc.arch
    if a.qk_layernorm_all_heads and (a.num_query_groups % tp or a.num_attention_heads % tp):
        raise ConfigError(f"--tensor-model-parallel-size {tp}: {mc.name}'s all-heads q/k norm is split over TP by "
                          f"whole heads, and {a.num_query_groups} KV heads / {a.num_attention_heads} query heads do "
                          f"not split into {tp}")


def check_dsa(mc: ModelConfig, kw: dict[str, Any]) -> None:
    """GLM-5's sparse attention (models/dsa.py) with the settings it cannot take, one line each (the
    same check as at submit: rlslurm/settings/sparse_attention.py)."""
    from rlslurm.settings.sparse_attention import sparse_attention_refusal

    if (why := sparse_attention_refusal(mc, megatron=kw, pp=kw.get("pipeline_model_parallel_size", 1),
                                        first=kw.get("num_layers_in_first_pipeline_stage"),
                                        last=kw.get("num_layers_in_last_pipeline_stage"),
                                        transformer_impl=kw.get("transformer_impl", LOCAL))) is not None:
        raise ConfigError(why)


# ---------------------------------------------------------------- layer-spec extensions


class TorchNorm:
    """megatron's local norm (torch RMSNorm/LayerNorm) without its sequence-parallel refusal.

    Megatron's `WrappedTorchNorm` asserts `not sequence_parallel`, yet megatron refuses to *train*
    MoE with TP > 1 unless sequence parallelism is on (moe_layer.py:379). Under sequence
    parallelism a norm on sequence-sharded activations only needs its weight grads summed over
    TP, which megatron's finalize_model_grads does for params marked `sequence_parallel`. So:
    `TorchNorm` (q/k/kv norms, which see the gathered sequence) and `SPTorchNorm` (the residual
    stream norms, marked) make MoE + TP trainable without transformer-engine.
    """

    mark_sequence_parallel = False

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.Module:
        if config.normalization == "RMSNorm" and config.layernorm_zero_centered_gamma:
            from rlslurm.models.gated_delta import ZeroCenteredRMSNorm

            norm: torch.nn.Module = ZeroCenteredRMSNorm(hidden_size, eps=eps)
        elif config.layernorm_zero_centered_gamma:
            raise ConfigError("layernorm_zero_centered_gamma with LayerNorm: not built without transformer-engine")
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        else:
            raise ConfigError(f"normalization={config.normalization!r}: expected RMSNorm or LayerNorm")
        if cls.mark_sequence_parallel and config.sequence_parallel:
            for p in norm.parameters():
                setattr(p, "sequence_parallel", True)
        return norm


class SPTorchNorm(TorchNorm):
    mark_sequence_parallel = True


def _norm_module(config) -> torch.nn.Module:
    if uses_te(config):
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm(config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)
    return SPTorchNorm(config, config.hidden_size, eps=config.layernorm_epsilon)


def _local_spec_fixes(block, tcfg) -> None:
    """Without TE: MLA's duplicated down projections; under sequence parallelism our torch norms."""
    from megatron.core.models.gpt.gpt_layer_specs import LNImpl

    if uses_te(tcfg):
        return
    for spec in {id(s.submodules): s for s in block.layer_specs}.values():  # layers share spec objects
        attn = getattr(spec.submodules.self_attention, "submodules", None)
        if getattr(attn, "linear_kv_down_proj", None) is not None:
            # MLA down projections as TP-duplicated linears (what the TE spec does), at every TP
            # so that checkpoints re-shard between TP sizes. As column-parallel linears (the local
            # spec), MLA gathers their outputs with gather_from_tensor_model_parallel_region, whose
            # backward only splits: the shared rope key k_pos_emb then gets each rank's partial
            # (own heads') gradient, and kv_down_proj/embedding grads are wrong at TP > 1
            # (measured, megatron-core 0.16). The duplicated path gathers k_pos_emb from the
            # sequence-parallel region, whose backward reduce-scatters, and marks the weights
            # `sequence_parallel` for the TP grad sum.
            from megatron.core.post_training.modelopt.layers import Linear

            for field in ("linear_q_down_proj", "linear_kv_down_proj"):
                setattr(attn, field, Linear)
            if tcfg.q_lora_rank is None and hasattr(spec.submodules.self_attention.module, "_resolve_qk_norm_config"):
                spec.submodules.self_attention = dataclasses.replace(
                    spec.submodules.self_attention,
                    module=_mla_without_query_latent(spec.submodules.self_attention.module))
    # Qwen3-Next's zero-centred norms: megatron's local norm refuses them, TorchNorm builds them
    if not tcfg.sequence_parallel and not tcfg.layernorm_zero_centered_gamma:
        return
    if block.layer_norm is LNImpl:
        block.layer_norm = SPTorchNorm
    for spec in block.layer_specs:
        sub = spec.submodules
        for field in ("input_layernorm", "pre_mlp_layernorm"):
            if getattr(sub, field, None) is LNImpl:
                setattr(sub, field, SPTorchNorm)
        attn = getattr(sub.self_attention, "submodules", None)
        for field in ("q_layernorm", "k_layernorm"):
            if getattr(attn, field, None) is LNImpl:
                setattr(attn, field, TorchNorm)  # finalize_model_grads sums these over TP by name
        if getattr(attn, "kv_layernorm", None) is LNImpl:
            # MLA: the kv norm feeds the head-split kv_up_proj, so each TP rank holds a partial
            # gradient, but finalize_model_grads' name rule ("q_layernorm"/"k_layernorm") misses
            # "kv_layernorm" (megatron-core 0.16). Marked, it is summed like the other SP norms.
            setattr(attn, "kv_layernorm", SPTorchNorm)


def _mla_without_query_latent(base: type) -> type:
    class MLAWithoutQueryLatent(base):  # type: ignore[misc,valid-type]
        """Moonlight (DeepSeek-V2-Lite): MLA without a query latent (q_lora_rank None) but with the kv
        latent's norm. megatron-core 0.19's norm resolver (transformer/mla_qk_norm_config.py) then asks for
        a fused norm+linear query projection, which the local backend does not have, and refuses a
        standalone query norm; HF applies none to the query (the layer's input norm comes first). The
        modules are 0.16's: a plain linear_q_proj, no query norm, the kv norm of the spec
        (docs/megatron-versions.md, "Layer specs")."""

        def _resolve_qk_norm_config(self, submodules):
            from megatron.core.transformer.identity_op import IdentityOp

            return dict(linear_q_proj=submodules.linear_q_proj, linear_q_up_proj=IdentityOp,
                        linear_kv_up_proj=submodules.linear_kv_up_proj, q_layernorm=IdentityOp,
                        kv_layernorm=submodules.kv_layernorm)

    return MLAWithoutQueryLatent


def _self_attention_with_post_norm(base: type) -> type:
    class SelfAttentionWithPostNorm(base):  # type: ignore[misc,valid-type]
        """GLM-4: a norm on the attention output before the residual add.

        The output of `linear_proj` (row-parallel, reduced over TP) is the full hidden state on
        every TP rank, so the norm is replicated like every other norm.
        """

        def __init__(self, config, *args: Any, **kwargs: Any):
            super().__init__(config, *args, **kwargs)
            self.post_self_attn_layernorm = _norm_module(config)

        def forward(self, *args: Any, **kwargs: Any):
            out, bias = super().forward(*args, **kwargs)
            if bias is not None:
                out, bias = out + bias, None  # norm applies to the biased output
            return self.post_self_attn_layernorm(out), bias

    return SelfAttentionWithPostNorm


def _self_attention_with_all_heads_qk_norm(base: type, q_heads: int, k_heads: int) -> type:
    class SelfAttentionWithAllHeadsQKNorm(base):  # type: ignore[misc,valid-type]
        """MiniMax-M2: rlslurm's all-heads q/k norms (models/qk_norm.py) as `q_layernorm`/`k_layernorm`,
        which SelfAttention applies when set. Built here rather than named in the spec: the config keeps
        megatron's `qk_layernorm` off for them, and megatron-core 0.19 refuses q/k norm submodules while
        it is off (docs/megatron-versions.md, "Layer specs")."""

        def __init__(self, config, *args: Any, **kwargs: Any):
            from rlslurm.models.qk_norm import AllHeadsRMSNorm

            super().__init__(config, *args, **kwargs)
            head_dim = self.hidden_size_per_attention_head
            self.q_layernorm = AllHeadsRMSNorm(config, head_dim, eps=config.layernorm_epsilon, heads=q_heads)
            self.k_layernorm = AllHeadsRMSNorm(config, head_dim, eps=config.layernorm_epsilon, heads=k_heads)

    return SelfAttentionWithAllHeadsQKNorm


def _mlp_with_post_norm(base: type) -> type:
    class MLPWithPostNorm(base):  # type: ignore[misc,valid-type]
        """GLM-4: a norm on the MLP output before the residual add (see SelfAttentionWithPostNorm)."""

        def __init__(self, config, *args: Any, **kwargs: Any):
            super().__init__(config, *args, **kwargs)
            self.post_mlp_layernorm = _norm_module(config)

        def forward(self, *args: Any, **kwargs: Any):
            out, bias = super().forward(*args, **kwargs)
            if bias is not None:
                out, bias = out + bias, None
            return self.post_mlp_layernorm(out), bias

        def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
            # MLP.sharded_state_dict asks every child for its own sharded_state_dict, which a plain
            # torch norm lacks: take the norm out, then add it as a replicated tensor.
            from megatron.core.transformer.utils import sharded_state_dict_default

            norm = self._modules.pop("post_mlp_layernorm")
            try:
                sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
            finally:
                self._modules["post_mlp_layernorm"] = norm
            kw: dict[str, Any] = {}
            if "tp_group" in inspect.signature(sharded_state_dict_default).parameters:
                # Without it every TP rank claims to be the main replica of the norm.
                from megatron.core import parallel_state as ps

                kw["tp_group"] = getattr(self, "tp_group", None) or ps.get_tensor_model_parallel_group()
            sd.update(sharded_state_dict_default(norm, f"{prefix}post_mlp_layernorm.", sharded_offsets,
                                                 metadata, **kw))
            return sd

    return MLPWithPostNorm


class SDPACoreAttention(torch.nn.Module):
    """Causal core attention by torch's scaled_dot_product_attention, without transformer-engine.

    Used for MLA (megatron's local `DotProductAttention` takes no `k_channels`/`v_channels`: the
    query/key head dim differs from the value's) and for every layer under `--qkv-format thd`
    (packed sequences: the local `DotProductAttention` refuses `packed_seq_params`). Packed, q/k/v
    come as [t, heads, dim] over the concatenated sequences of a micro-batch, and each sequence
    attends causally within itself (`cu_seqlens`): on CUDA one flash varlen call, elsewhere one SDPA
    call per sequence; no [t, t] mask is built (docs/sequence-packing.md).
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 softmax_scale: float | None = None, **_: Any):
        super().__init__()
        self.config = config
        self.softmax_scale = softmax_scale
        self.attn_mask_type = attn_mask_type

    def _sdpa(self, q, k, v):
        """[b, h, s, d] causal attention; grouped query heads repeated as megatron's local path does."""
        k, v = repeat_kv_heads(q, k, v)
        # On CUDA the flash / memory-efficient kernels accumulate the softmax in fp32 themselves and
        # take no fp32 inputs (an fp32 upcast falls back to the math kernel, measured slower on H200:
        # bench/results/packing-h200.md); elsewhere upcast as megatron does.
        if self.config.attention_softmax_in_fp32 and q.dtype != torch.float32 and not q.is_cuda:
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True,
                                                  scale=self.softmax_scale).to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **_: Any):
        if self.config.context_parallel_size > 1:
            return self._context_parallel(query, key, value, packed_seq_params)
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd":
                raise NotImplementedError(f"SDPACoreAttention: qkv_format {packed_seq_params.qkv_format!r}")
            # flash varlen takes fp16/bf16 only ("FlashAttention only support fp16 and bf16": the fp32
            # demo with --qkv-format thd on an H100); fp32 keeps the per-sequence loop below
            if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and varlen_attn() is not None:
                return varlen_causal(query, key, value, packed_seq_params, self.softmax_scale)
            # [t, h, d] -> per sequence [1, h, s, d] -> [t, h * dv]
            bounds = packed_seq_params.cu_seqlens_q.tolist()
            outs = []
            for a, b in zip(bounds[:-1], bounds[1:]):
                q, k, v = (t[a:b].permute(1, 0, 2).unsqueeze(0) for t in (query, key, value))
                outs.append(self._sdpa(q, k, v)[0].permute(1, 0, 2).reshape(b - a, -1))
            return torch.cat(outs, dim=0)
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = self._sdpa(q, k, v)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


    def _context_parallel(self, query, key, value, packed_seq_params):
        """CP > 1: this rank's queries against every CP rank's keys (models/context_parallel.py)."""
        from rlslurm.models import context_parallel as cpx

        fp32 = bool(self.config.attention_softmax_in_fp32)
        if packed_seq_params is None:
            return cpx.attend_padded(query, key, value, scale=self.softmax_scale, fp32=fp32, group=cpx.cp_group())
        if packed_seq_params.qkv_format != "thd":
            raise NotImplementedError(f"SDPACoreAttention: qkv_format {packed_seq_params.qkv_format!r}")
        use_varlen = query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and varlen_attn() is not None
        return cpx.attend_packed(query, key, value, packed_seq_params.cu_seqlens_q, scale=self.softmax_scale,
                                 fp32=fp32, group=cpx.cp_group(), varlen=varlen_attn() if use_varlen else None)


def _extend_mlp_spec(mc: ModelConfig, mlp_spec):
    """The dense MLP spec with GLM-4's post-MLP norm, for both spec styles megatron has used."""
    if isinstance(mlp_spec, functools.partial):
        # megatron-core 0.19: `partial(MLP.as_mlp_submodule, submodules=...)`, a classmethod that
        # builds `cls(...)`: rebind it to the subclass.
        owner = getattr(mlp_spec.func, "__self__", None)
        if not isinstance(owner, type):
            raise ConfigError(f"model config {mc.name}: cannot extend MLP spec {mlp_spec!r} with post_mlp_layernorm")
        return functools.partial(getattr(_mlp_with_post_norm(owner), mlp_spec.func.__name__),
                                 *mlp_spec.args, **mlp_spec.keywords)
    params = dict(mlp_spec.params or {})
    # 0.16: TransformerLayer hands tp_group only to classes it knows; pass it through the spec.
    if "tp_group" in inspect.signature(mlp_spec.module.__init__).parameters and "tp_group" not in params:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            params["tp_group"] = ps.get_tensor_model_parallel_group()
    return dataclasses.replace(mlp_spec, module=_mlp_with_post_norm(mlp_spec.module), params=params)


def _gated_delta_net_layers(mc: ModelConfig, block, tcfg, *, vp_stage: int | None) -> None:
    """Qwen3-Next: the linear-attention layers of this stage get megatron-core's GatedDeltaNet as their
    `self_attention` (the rest of each layer, norms and MLP/MoE, is the stock spec's).

    megatron's own hybrid spec (`experimental_attention_variant_module_specs`) would place it, but
    accepts transformer-engine only, and GatedDeltaNet refuses to build without fla: rlslurm installs
    its own kernels into that module (models/gated_delta.py `install`) and builds this spec itself,
    as megatron's `get_gated_delta_net_module_spec` does: in_proj column-parallel (with TE the
    input norm fused into it, as megatron's spec does), the output norm rlslurm's GatedOutputNorm
    (HF's plain-weight gated norm, not the zero-centred norm of the rest), out_proj row-parallel.
    docs/model-families.md, "Qwen3-Next"."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from rlslurm.models import gated_delta

    gated_delta.install()
    if uses_te(tcfg):
        from megatron.core.extensions.transformer_engine import TELayerNormColumnParallelLinear, TERowParallelLinear

        in_proj, out_proj = TELayerNormColumnParallelLinear, TERowParallelLinear
    else:
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

        in_proj, out_proj = ColumnParallelLinear, RowParallelLinear
    # megatron's GatedDeltaNet, with rlslurm's context parallelism (its forward at CP 1)
    gdn = ModuleSpec(module=gated_delta.context_parallel_gated_delta_net(), submodules=GatedDeltaNetSubmodules(
        in_proj=in_proj, out_norm=gated_delta.GatedOutputNorm, out_proj=out_proj))
    interval = mc.arch.gated_delta_net.full_attention_interval
    from megatron.core import parallel_state as ps

    # this stage's first layer (no process groups, as in unit tests: the whole model on one stage)
    offset = get_transformer_layer_offset(tcfg, vp_stage=vp_stage) if ps.model_parallel_is_initialized() else 0
    specs = []
    for i, spec in enumerate(block.layer_specs):
        if (offset + i + 1) % interval:  # linear attention (HF layer_types "linear_attention")
            spec = dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=gdn))
        specs.append(spec)
    block.layer_specs = specs


def layer_specs(mc: ModelConfig, tcfg, *, vp_stage: int | None = None, packed: bool = False):
    """The decoder block spec for `mc`: stock megatron specs plus the extensions above;
    `packed` (--qkv-format thd): core attention that takes packed sequences."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    if packed:
        check_gated_delta_net(mc.arch, mc.name, tp=1, qkv_format="thd")
    te = uses_te(tcfg)
    kw: dict[str, Any] = {"use_transformer_engine": te}
    params = inspect.signature(get_gpt_decoder_block_spec).parameters
    if "normalization" in params:
        kw["normalization"] = tcfg.normalization
    if "vp_stage" in params:
        kw["vp_stage"] = vp_stage
    # The stock dense/MoE layer specs with the experimental attention variant (gated delta net, DSA)
    # unset: rlslurm places those modules itself below. megatron-core 0.19 asserts the field unset
    # here (docs/megatron-versions.md, "Layer specs"); the model is still built with tcfg as it is.
    stock = copy.copy(tcfg)
    stock.experimental_attention_variant = None
    block = get_gpt_decoder_block_spec(stock, **kw)
    a = mc.arch
    if a.gated_delta_net is not None:
        _gated_delta_net_layers(mc, block, tcfg, vp_stage=vp_stage)
    _local_spec_fixes(block, tcfg)
    holder: dict = {}  # GLM-5.2: each indexer layer's top-k, for the shared layers after it (models/dsa.py)
    seen: set[int] = set()
    for spec in block.layer_specs:
        # Several layers share one spec object: extend each object once.
        if id(spec) in seen:
            continue
        seen.add(id(spec))
        sub = spec.submodules
        if a.qk_layernorm_all_heads:
            sub.self_attention = dataclasses.replace(sub.self_attention, module=_self_attention_with_all_heads_qk_norm(
                sub.self_attention.module, a.num_attention_heads, a.num_query_groups))
        if a.post_self_attn_layernorm:
            sub.self_attention = dataclasses.replace(
                sub.self_attention, module=_self_attention_with_post_norm(sub.self_attention.module))
        if a.post_mlp_layernorm:
            if a.moe:
                raise ConfigError(f"model config {mc.name}: post_mlp_layernorm with MoE is not supported")
            sub.mlp = _extend_mlp_spec(mc, sub.mlp)
        if a.dsa is not None:
            if packed:
                from rlslurm.settings.sparse_attention import sparse_attention_refusal

                raise ConfigError(sparse_attention_refusal(mc, qkv_format="thd"))
            from megatron.core.transformer.identity_op import IdentityOp

            from rlslurm.models.dsa import core_attention_spec

            if getattr(sub.self_attention.submodules, "q_layernorm", None) in (None, IdentityOp):
                # transformer-engine's MLA spec fuses the query-latent norm into linear_q_up_proj; MLA
                # would then hand the indexer the un-normalised latent, transformers the normalised one
                raise ConfigError(f"model config {mc.name}: its sparse attention needs MLA's query-latent norm as "
                                  "a module of its own (megatron's local spec), not fused into linear_q_up_proj "
                                  "(transformer-engine's): the indexer reads the normalised latent")
            sub.self_attention.submodules.core_attention = core_attention_spec(holder)
        elif (packed or tcfg.context_parallel_size > 1) and not te:
            # packed input, or context parallelism (docs/context-parallel.md): megatron's local
            # DotProductAttention takes neither
            sub.self_attention.submodules.core_attention = SDPACoreAttention
        elif a.mla and not te:
            core = sub.self_attention.submodules.core_attention
            takes_k = "k_channels" in inspect.signature(getattr(core, "module", core).__init__).parameters
            if not takes_k:
                sub.self_attention.submodules.core_attention = SDPACoreAttention
    if a.dsa is not None and a.dsa.shared_layers:
        _share_top_k(mc, tcfg, block, holder, vp_stage)
    return block


def _share_top_k(mc: ModelConfig, tcfg, block, holder: dict, vp_stage: int | None) -> None:
    """GLM-5.2: the shared layers of this stage get a core attention of their own (no indexer: the
    top-k of the last indexer layer before them, models/dsa.py SharedTopKAttention)."""
    import copy

    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from rlslurm.models.dsa import shared_attention_spec, source_layer

    offset = get_transformer_layer_offset(tcfg, vp_stage=vp_stage)
    shared = set(mc.arch.dsa.shared_layers)
    for i, spec in enumerate(block.layer_specs):
        if offset + i not in shared:
            continue
        if i == 0:
            raise ConfigError(f"model config {mc.name}: the pipeline stage starting at layer {offset} starts with a "
                              "shared sparse-attention layer, whose top-k comes from a layer of an earlier stage")
        spec = copy.deepcopy(spec)
        spec.submodules.self_attention.submodules.core_attention = shared_attention_spec(
            holder, source_layer(mc, offset + i) + 1)
        block.layer_specs[i] = spec


def build_gpt_model(
    mc: ModelConfig,
    tcfg,
    *,
    pre_process: bool = True,
    post_process: bool = True,
    vocab_size_padded: int,
    vp_stage: int | None = None,
    share_embeddings: bool | None = None,
    packed: bool = False,
):
    """Build the GPTModel for `mc` (parallel state must be initialised for tcfg's sizes).

    With pipeline parallelism pass this stage's `pre_process` (first stage: embedding) and
    `post_process` (last stage: final norm + output layer); megatron picks the stage's layers.
    `share_embeddings=None` ties embedding and output layer as the architecture does; the PPO
    critic passes False (its output layer becomes a value head, see setup.ValueHead).
    """
    from megatron.core.models.gpt import GPTModel

    from rlslurm.models import cpu_shim

    cpu_shim.apply_megatron_fixes()
    a = mc.arch
    if vocab_size_padded < a.vocab_size:
        raise ConfigError(f"vocab_size_padded={vocab_size_padded} < model vocab_size={a.vocab_size}")
    kw: dict[str, Any] = dict(
        config=tcfg,
        transformer_layer_spec=layer_specs(mc, tcfg, vp_stage=vp_stage, packed=packed),
        vocab_size=vocab_size_padded,
        max_sequence_length=a.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=a.tie_word_embeddings if share_embeddings is None else share_embeddings,
        position_embedding_type="rope",
        rotary_percent=a.rotary_percent,
        rotary_base=int(a.rotary_base) if float(a.rotary_base).is_integer() else a.rotary_base,
    )
    if a.rope_scaling is not None and not a.mla:
        kw.update(rope_scaling=True, rope_scaling_factor=a.rope_scaling.factor)
    if vp_stage is not None:
        kw["vp_stage"] = vp_stage
    params = inspect.signature(GPTModel.__init__).parameters
    kw = {k: v for k, v in kw.items() if k in params}
    model = GPTModel(**kw)
    if a.dsa is not None:
        from rlslurm.models.dsa import freeze_indexer

        freeze_indexer(model)  # GLM-5's indexer is not trained (models/dsa.py)
    if torch.cuda.is_available():
        # What Megatron-LM's get_model does: megatron's parallel layers allocate on the GPU, plain
        # torch modules (norms) on the CPU.
        model.cuda(torch.cuda.current_device())
    return model
