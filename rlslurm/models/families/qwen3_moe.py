"""Qwen3-MoE: Qwen3 attention, routed experts behind a softmax router in every layer, no shared
expert."""

from __future__ import annotations

from rlslurm.errors import ConfigError
from rlslurm.models.family import HF, Block, Family, Field, fixed
from rlslurm.models.rules import PRE_MLP_NORM, dense_or_moe, gqa_attention
from rlslurm.models.tables import BIAS


def layer_rules(mc, layer: int) -> list:
    return gqa_attention(mc, qk_norm=True) + [PRE_MLP_NORM] + dense_or_moe(mc, layer)


def refuse(hf: HF) -> None:
    if hf("mlp_only_layers") or hf("decoder_sparse_step", 1) != 1:
        raise ConfigError(f"{hf.name}: HF config uses mlp_only_layers/decoder_sparse_step != 1, "
                          "which the qwen3_moe mapping does not support")


MOE = Block("moe", "num_experts", (
    Field("moe.num_experts", "num_experts"),
    Field("moe.router_topk", "num_experts_per_tok"),
    Field("moe.moe_ffn_hidden_size", "moe_intermediate_size"),
    Field("moe.router_topk_norm", "norm_topk_prob", read=lambda hf: bool(hf("norm_topk_prob", False))),
    fixed("moe.router_score_function", "(qwen3_moe router)", "softmax"),
    fixed("moe.shared_expert_ffn_hidden_size", "(qwen3_moe)", 0),
    # every layer MoE: written as the release does, no dense layers
    Field("moe.first_k_dense", "mlp_only_layers", read=lambda hf: 0,
          write=lambda a: {"decoder_sparse_step": 1, "mlp_only_layers": []}),
))

FAMILY = Family(
    name="qwen3_moe",
    fixed={"qk_layernorm": True, "add_qkv_bias": False, "rotary_interleaved": False,
           "post_self_attn_layernorm": False, "post_mlp_layernorm": False, "normalization": "RMSNorm"},
    fields=BIAS,
    blocks=(MOE,),
    refuse=refuse,
    layer_rules=layer_rules,
)
