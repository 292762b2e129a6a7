"""Build the actor's megatron-core `GPTModel` from a model config.

- `transformer_config(mc, ...)` turns the architecture numbers of `rlslurm.settings.model_config.Arch`
  into a `TransformerConfig` (an `MLATransformerConfig` for MLA models) plus the user's
  `--megatron-<field>` overrides.
- `build_gpt_model(mc, tcfg, ...)` builds the model with megatron's local layer spec, or
  transformer-engine's with `--transformer-impl transformer_engine` (tcfg.transformer_impl; never
  because transformer-engine imports: rlslurm/settings/transformer_impl.py), changed by `layer_specs`:
  the core attention and norms every family needs without transformer-engine, then the family's own
  layers through its Family.layer_spec (models/specs.py; rlslurm/models/families/).
- `padded_vocab_size(vocab, tp)`: Megatron shards the vocabulary over TP, so the embedding is
  padded to a multiple of `divisible_by * tp`; `rlslurm.convert` pads on import and trims on export.

Works with megatron-core 0.16.x (CPU, Python 3.11) and 0.19.x (GPU): keyword arguments that one
version lacks are dropped by checking the dataclass fields / signatures rather than the version; the
other differences it relies on are in docs/megatron-versions.md.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from typing import Any

import torch
import torch.nn.functional as F

from rlslurm.errors import ConfigError
from rlslurm.models import packed_rope
from rlslurm.models.family import family_of
from rlslurm.models.specs import core_attention, local_spec_fixes, uses_te
from rlslurm.settings.model_config import ModelConfig
from rlslurm.settings.parallel_grid import (
    check_gated_delta_net,
    check_pipeline_split,
    owned_field_refusal,
    stage_layers,
)
from rlslurm.settings.transformer_impl import LOCAL, TE, te_refusal

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
        kw.update(_moe_kwargs(mc, te=te))
    if a.gated_delta_net:
        kw.update(_gated_delta_kwargs(mc))
    if a.mla:
        kw.update(_mla_kwargs(mc))
    elif a.rope_scaling is not None:
        _check_rope_scaling(mc)
    return kw


def _moe_kwargs(mc: ModelConfig, *, te: bool) -> dict[str, Any]:
    """The MoE fields: the family's router, no load balancing, the dispatcher this implementation runs."""
    a, m = mc.arch, mc.arch.moe
    if m.router_score_function == "sigmoid" and not m.router_topk_norm:
        raise ConfigError(
            f"model config {mc.name}: arch.moe.router_topk_norm=false with sigmoid scores is not "
            "supported by megatron-core (it always renormalises sigmoid top-k)"
        )
    return dict(
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


def _gated_delta_kwargs(mc: ModelConfig) -> dict[str, Any]:
    """Qwen3-Next's linear-attention layers: megatron-core's GatedDeltaNet with rlslurm's kernels,
    placed by rlslurm's layer spec (layer_specs; megatron's own hybrid spec builder needs
    transformer-engine). Same int rule as HF's full_attention_interval. (transformer_config unsets
    experimental_attention_variant at CP > 1: megatron asserts CP 1 with it.)"""
    d = mc.arch.gated_delta_net
    return dict(experimental_attention_variant="gated_delta_net", linear_attention_freq=d.full_attention_interval,
                linear_conv_kernel_dim=d.conv_kernel_dim, linear_key_head_dim=d.key_head_dim,
                linear_value_head_dim=d.value_head_dim, linear_num_key_heads=d.num_key_heads,
                linear_num_value_heads=d.num_value_heads)


def _mla_kwargs(mc: ModelConfig) -> dict[str, Any]:
    """Multi-latent attention's sizes and rope (plain or yarn), and GLM-5's sparse attention on it."""
    a, m2, rs = mc.arch, mc.arch.mla, mc.arch.rope_scaling
    kw: dict[str, Any] = dict(
        multi_latent_attention=True,
        q_lora_rank=m2.q_lora_rank,
        kv_lora_rank=m2.kv_lora_rank,
        qk_head_dim=m2.qk_head_dim,
        qk_pos_emb_head_dim=m2.qk_pos_emb_head_dim,
        v_head_dim=m2.v_head_dim,
        rotary_base=a.rotary_base,
        rotary_percent=a.rotary_percent,
    )
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
    return kw


def _check_rope_scaling(mc: ModelConfig) -> None:
    """Megatron's llama3 rope scaling hard-codes low/high freq factors 1/4 and original 8192."""
    rs = mc.arch.rope_scaling
    if rs.type != "llama3" or (rs.low_freq_factor, rs.high_freq_factor, rs.original_max_position_embeddings) not in (
        (1.0, 4.0, 8192), (None, None, 8192)
    ):
        raise ConfigError(
            f"model config {mc.name}: arch.rope_scaling {rs.model_dump(exclude_none=True)} is not supported "
            "for non-MLA models (only llama3 with low_freq_factor=1, high_freq_factor=4, "
            "original_max_position_embeddings=8192)"
        )


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
    _check_overrides(overrides or {}, cls, fields)
    stage_layers(mc.arch.num_layers, pp, first_stage_layers, last_stage_layers, model=mc.name)
    check_all_heads_qk_norm(mc, tp)
    check_gated_delta_net(mc.arch, mc.name, tp=tp)
    check_pipeline_split(overrides or {}, pp)
    if params_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ConfigError(f"params_dtype={params_dtype}: expected float32, bfloat16 or float16")
    etp = tp if etp is None else etp
    kw: dict[str, Any] = dict(_SAFE_DEFAULTS)
    kw.update(_arch_kwargs(mc, te=te))
    kw.update(_parallel_kwargs(mc, tp=tp, pp=pp, ep=ep, cp=cp, etp=etp, stages=(first_stage_layers, last_stage_layers),
                               params_dtype=params_dtype, transformer_impl=transformer_impl, device=device))
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
    _check_settings(mc, kw, tp=tp, ep=ep, etp=etp, te=te)
    return _make_config(cls, mc, {k: v for k, v in kw.items() if k in fields})


def _check_overrides(overrides: dict[str, Any], cls: type, fields: set[str]) -> None:
    """Each --megatron-<field>: one rlslurm does not own, of megatron-core's config class."""
    for key in overrides:
        if (why := owned_field_refusal(key)) is not None:
            raise ConfigError(why)
        if key not in fields:
            raise ConfigError(
                f"--megatron-{key.replace('_', '-')}: {key!r} is not a megatron-core {cls.__name__} field"
            )


def _parallel_kwargs(mc: ModelConfig, *, tp: int, pp: int, ep: int, cp: int, etp: int,
                     stages: tuple[int | None, int | None], params_dtype: torch.dtype, transformer_impl: str,
                     device: str) -> dict[str, Any]:
    """TransformerConfig fields that follow from the parallel sizes, the dtype and the implementation."""
    kw: dict[str, Any] = dict(
        transformer_impl=transformer_impl,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        num_layers_in_first_pipeline_stage=stages[0],
        num_layers_in_last_pipeline_stage=stages[1],
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        context_parallel_size=cp,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        pipeline_dtype=params_dtype,
    )
    if transformer_impl != TE:
        kw["use_cpu_initialization"] = device == "cpu"
    # megatron trains MoE with TP > 1 only under sequence parallelism (moe_layer.py:379); with
    # it, sequence lengths must be divisible by TP.
    # MLA's TP > 1 backward is only right under sequence parallelism (models/specs.py local_spec_fixes).
    # Gated delta nets: their output norm sees only this rank's value heads, so its weight gradient is
    # partial per rank; as a sequence-parallel parameter finalize_model_grads sums it over TP
    # (models/gated_delta.py GatedOutputNorm).
    kw["sequence_parallel"] = tp > 1 and (mc.arch.moe is not None or mc.arch.mla is not None
                                          or mc.arch.gated_delta_net is not None)
    # RL micro-batches are right-padded to their own longest sample and dynamic batching varies
    # their sample count, so pipeline stages must exchange each activation's shape before it
    # (megatron's schedule otherwise assumes one fixed [seq, micro_batch, hidden] per call).
    kw["variable_seq_lengths"] = pp > 1
    if pp > 1 or _mixes_dp(tp, ep, etp):
        # The allgather token dispatcher gathers equal-sized chunks from the ETP x EP ranks, but at
        # EP > 1 those ranks belong to different DP ranks, whose micro-batches have different
        # shapes (gloo aborts: "Received data size doesn't match expected size");
        # megatron also refuses it under variable_seq_lengths (its default even for dense models,
        # where it is never used). The alltoall one exchanges token counts first, and gives the
        # same outputs (docs/megatron-cpu.md, "MoE token dispatcher and its side stream"; the CPU
        # shim fakes that side stream).
        kw["moe_token_dispatcher_type"] = "alltoall"
    return kw


def _mixes_dp(tp: int, ep: int, etp: int) -> bool:
    """Whether the experts' ETP x EP group holds ranks of different DP index: unless ETP x EP divides
    TP (it then lies within a dense TP group, rlslurm/settings/parallel_grid.py); EP > 1 always does."""
    return ep > 1 or tp % etp != 0


def _check_settings(mc: ModelConfig, kw: dict[str, Any], *, tp: int, ep: int, etp: int, te: bool) -> None:
    """The settings (overrides included) the model cannot train with, one line each."""
    if _mixes_dp(tp, ep, etp) and kw.get("moe_token_dispatcher_type") == "allgather":
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


def _make_config(cls: type, mc: ModelConfig, kw: dict[str, Any]):
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


def layer_specs(mc: ModelConfig, tcfg, *, vp_stage: int | None = None, packed: bool = False):
    """The decoder block spec for `mc`: megatron's stock specs, the core attention the settings need
    (models/specs.py), then the family's own changes (its Family.layer_spec); `packed`
    (--qkv-format thd): core attention that takes packed sequences."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    if packed:
        check_gated_delta_net(mc.arch, mc.name, tp=1, qkv_format="thd")
        packed_rope.install()  # megatron's unfused thd rotary reads the lengths back per layer (models/packed_rope.py)
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
    local_spec_fixes(block, tcfg)
    if not te:
        core_attention(mc, block, tcfg, packed=packed)
    family = family_of(mc.hf_model_type)
    if family is not None and family.layer_spec is not None:
        family.layer_spec(mc, block, tcfg, vp_stage=vp_stage, packed=packed)
    return block


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
