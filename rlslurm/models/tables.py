"""The rows of the Arch <-> config.json table that several families share (models/family.py Field).

COMMON is every family's (sizes, norms, rope); a family row naming the same Arch field replaces
one of them (MLA's kv_channels, Qwen3.5 MoE's ffn_hidden_size). The blocks below are the shared
shapes of an optional part: DeepSeek-V3's MLA and sigmoid-routed MoE, which GLM-4.5, GLM-4.7-Flash
and GLM-5 spell the same way.
"""

from __future__ import annotations

from typing import Any

from rlslurm.errors import ConfigError
from rlslurm.models.family import HF, Block, Field, fixed

ACTIVATION = {"silu": "swiglu", "gelu": "gelu"}

COMMON: tuple[Field, ...] = (
    Field("num_layers", "num_hidden_layers"),
    Field("hidden_size", "hidden_size"),
    Field("ffn_hidden_size", "intermediate_size"),
    Field("num_attention_heads", "num_attention_heads"),
    Field("num_query_groups", "num_key_value_heads",
          read=lambda hf: hf("num_key_value_heads") or hf("num_attention_heads")),
    Field("vocab_size", "vocab_size"),
    Field("max_position_embeddings", "max_position_embeddings", compared=False),
    Field("norm_epsilon", "rms_norm_eps"),
    Field("rotary_base", "rope_parameters.rope_theta", read=lambda hf: hf.rope.get("rope_theta", 10000.0),
          write=lambda a: {"rope_theta": a.rotary_base}),
    Field("rotary_percent", "partial_rotary_factor", read=lambda hf: hf.rope.get("partial_rotary_factor", 1.0),
          write=lambda a: {"partial_rotary_factor": a.rotary_percent} if a.rotary_percent != 1.0 else {}),
    Field("tie_word_embeddings", "tie_word_embeddings", read=lambda hf: bool(hf("tie_word_embeddings", False))),
    Field("activation", "hidden_act", read=lambda hf: ACTIVATION.get(hf("hidden_act"), hf("hidden_act")),
          write=lambda a: {"hidden_act": {v: k for k, v in ACTIVATION.items()}[a.activation]}),
    Field("kv_channels", "head_dim",
          read=lambda hf: hf("head_dim") or hf("hidden_size") // hf("num_attention_heads")),
)

# q/k/v and MLP biases as config.json's switches say (families whose modeling code reads them);
# only attention_bias is written, as the releases do
BIAS: tuple[Field, ...] = (
    Field("add_qkv_bias", "attention_bias", read=lambda hf: bool(hf("attention_bias", False))),
    Field("add_bias_linear", "mlp_bias", read=lambda hf: bool(hf("mlp_bias", False)), write=lambda a: {}),
)

# partial rotary spelt out even at 1 (a config class whose default is not 1: GLM-4.5's 0.5)
ROTARY_PERCENT_ALWAYS = Field("rotary_percent", "partial_rotary_factor",
                              read=lambda hf: hf.rope.get("partial_rotary_factor", 1.0),
                              write=lambda a: {"partial_rotary_factor": a.rotary_percent})

# MLA: the attention's head dim is MLA's own; kv_channels is only read (the shipped MLA configs say
# v_head_dim), never compared or written (DeepSeek derives head_dim from the rope dim)
MLA_KV_CHANNELS = Field("kv_channels", "v_head_dim", compared=False, write=lambda a: {})

MLA = Block("mla", "kv_lora_rank", (
    Field("mla.q_lora_rank", "q_lora_rank"),
    Field("mla.kv_lora_rank", "kv_lora_rank"),
    Field("mla.qk_head_dim", "qk_nope_head_dim"),
    Field("mla.qk_pos_emb_head_dim", "qk_rope_head_dim"),
    Field("mla.v_head_dim", "v_head_dim"),
))


def refuse_mla(hf: HF) -> None:
    """Settings of DeepSeek-V3's attention that megatron-core's MLA does not build."""
    if hf("attention_bias", False):
        # HF then adds biases to q_a_proj, kv_a_proj_with_mqa and o_proj; megatron-core's MLA
        # builds those linears without (multi_latent_attention.py)
        raise ConfigError(f"{hf.name}: HF {hf.model_type} config has attention_bias=true, which megatron-core's "
                          "multi-latent attention does not build")
    if not hf("rope_interleave", True):
        raise ConfigError(f"{hf.name}: HF {hf.model_type} config has rope_interleave=false, which the mapping "
                          "does not support")


def leading_dense(types: list[str] | None) -> int:
    """How many entries of an HF mlp_layer_types list are "dense" before the first other one."""
    types = list(types or [])
    return next((i for i, t in enumerate(types) if t != "dense"), len(types))


def layer_types_first_dense(hf: HF) -> int:
    """The leading dense layers of a family built from `mlp_layer_types` (GLM-4.7-Flash, GLM-5).
    transformers builds each layer from `mlp_layer_types` (default: one dense, then sparse) and
    ignores first_k_dense_replace; SGLang reads first_k_dense_replace. Both must say the same, and
    the dense layers must lead."""
    types = list(hf("mlp_layer_types") or [])
    k = leading_dense(types)
    if any(t != "sparse" for t in types[k:]):
        raise ConfigError(f"{hf.name}: HF {hf.model_type} mlp_layer_types {types} is not dense layers followed by "
                          "sparse ones, which is all megatron-core's moe_layer_freq here expresses")
    fk = hf("first_k_dense_replace")
    if fk is not None and fk != k:
        raise ConfigError(f"{hf.name}: HF {hf.model_type} config has first_k_dense_replace={fk} (SGLang's) but "
                          f"mlp_layer_types starts with {k} dense layer(s) (transformers')")
    return k


def _n_shared(a: Any) -> dict[str, Any]:
    m = a.moe
    return {"n_shared_experts": m.shared_expert_ffn_hidden_size // m.moe_ffn_hidden_size}


def _mlp_layer_types(a: Any) -> dict[str, Any]:
    k = a.moe.first_k_dense
    # transformers builds the layers from mlp_layer_types, SGLang from first_k_dense_replace: both
    return {"first_k_dense_replace": k, "mlp_layer_types": ["dense"] * k + ["sparse"] * (a.num_layers - k)}


def sigmoid_router_moe(family: str, scoring: Field, *, layer_types: bool = False) -> Block:
    """DeepSeek-V3-style MoE (deepseek_v3, glm4_moe, glm4_moe_lite, glm_moe_dsa): routed experts behind
    a sigmoid router with a score-correction bias and group-limited top-k, n_shared_experts shared
    experts of moe_intermediate_size each, first_k_dense_replace dense layers (`layer_types`: those
    mlp_layer_types says, layer_types_first_dense)."""
    first_dense = (Field("moe.first_k_dense", "mlp_layer_types", read=layer_types_first_dense,
                         write=_mlp_layer_types) if layer_types else
                   Field("moe.first_k_dense", "first_k_dense_replace",
                         read=lambda hf: hf("first_k_dense_replace") or 0))
    return Block("moe", "n_routed_experts", (
        Field("moe.num_experts", "n_routed_experts"),
        Field("moe.router_topk", "num_experts_per_tok"),
        Field("moe.moe_ffn_hidden_size", "moe_intermediate_size"),
        Field("moe.shared_expert_ffn_hidden_size", "n_shared_experts*moe_intermediate_size",
              read=lambda hf: (hf("n_shared_experts") or 0) * hf("moe_intermediate_size"), write=_n_shared),
        first_dense,
        scoring,
        Field("moe.router_topk_norm", "norm_topk_prob", read=lambda hf: bool(hf("norm_topk_prob", False))),
        Field("moe.router_scaling_factor", "routed_scaling_factor", default=1.0),
        Field("moe.router_num_groups", "n_group", read=lambda hf: hf("n_group") or 1),
        Field("moe.router_group_topk", "topk_group", read=lambda hf: hf("topk_group") or 1),
        fixed("moe.router_expert_bias", f"({family} e_score_correction_bias)", True),
    ))


def deepseek_v3_router_fields(a: Any) -> dict[str, Any]:
    """The router fields of DeepSeek-V3's config.json that transformers drops and SGLang reads: every
    layer after the leading dense ones is MoE (moe_layer_freq 1), scored by the router's function,
    with the correction bias (noaux_tc)."""
    m = a.moe
    return dict(moe_layer_freq=1, scoring_func=m.router_score_function,
                topk_method="noaux_tc" if m.router_expert_bias else "greedy")


def no_bias(mc: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json without attention_bias, for families whose config class has no such field."""
    cfg.pop("attention_bias", None)
    return cfg
