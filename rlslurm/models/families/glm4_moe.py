"""GLM-4.5 (MoE): GQA with q/k/v biases, per-head q/k norm only where config.json says use_qk_norm
(the 355B model; Air has none), rotate_half over the first partial_rotary_factor of each head (no
re-layout: megatron rotates the first rotary_percent of each head as HF does), no sandwich norms;
first_k_dense dense layers with separate gate/up, then routed experts with a sigmoid router and its
correction bias plus shared experts, named as DeepSeek-V3's. The MTP layers released checkpoints
append (`model.layers.{num_layers}.*`, num_nextn_predict_layers) have no rule: never loaded, trained
or exported, and that field is not compared (docs/model-families.md)."""

from __future__ import annotations

from typing import Any

from rlslurm.models.family import Family, Field, fixed
from rlslurm.models.rules import PRE_MLP_NORM, dense_or_moe, gqa_attention
from rlslurm.models.tables import BIAS, ROTARY_PERCENT_ALWAYS, sigmoid_router_moe


def layer_rules(mc, layer: int) -> list:
    return gqa_attention(mc, qk_norm=mc.arch.qk_layernorm) + [PRE_MLP_NORM] + dense_or_moe(mc, layer)


def to_hf(mc: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    cfg.update(num_nextn_predict_layers=0)
    return cfg


FAMILY = Family(
    name="glm4_moe",
    fixed={"rotary_interleaved": False, "post_self_attn_layernorm": False, "post_mlp_layernorm": False,
           "normalization": "RMSNorm"},
    fields=(*BIAS, ROTARY_PERCENT_ALWAYS,
            Field("qk_layernorm", "use_qk_norm", read=lambda hf: bool(hf("use_qk_norm", False)))),
    blocks=(sigmoid_router_moe("glm4_moe", fixed("moe.router_score_function", "(glm4_moe router)", "sigmoid")),),
    to_hf=to_hf,
    layer_rules=layer_rules,
)
