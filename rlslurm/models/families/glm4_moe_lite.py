"""GLM-4.7-Flash: DeepSeek-V3's MLA and sigmoid-routed MoE under GLM's names for the config
(transformers' Glm4MoeLiteAttention is DeepseekV3Attention), DeepSeek-V3's tensor names; the dense
layers are those mlp_layer_types says. The MTP layer released checkpoints append
(`model.layers.{num_layers}.*`) has no rule (docs/model-families.md)."""

from __future__ import annotations

from typing import Any

from rlslurm.models.families import deepseek_v3
from rlslurm.models.family import Family, fixed
from rlslurm.models.tables import MLA, MLA_KV_CHANNELS, refuse_mla, sigmoid_router_moe


def to_hf(mc: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    cfg.pop("attention_bias", None)
    cfg.update(num_nextn_predict_layers=0, rope_interleave=True)
    return cfg


FAMILY = Family(
    name="glm4_moe_lite",
    fixed=deepseek_v3.MLA_FIXED,
    fields=(MLA_KV_CHANNELS,),
    blocks=(sigmoid_router_moe("glm4_moe_lite", fixed("moe.router_score_function", "(glm4_moe_lite router)",
                                                      "sigmoid"), layer_types=True), MLA),
    refuse=refuse_mla,
    to_hf=to_hf,
    layer_rules=deepseek_v3.layer_rules,
)
