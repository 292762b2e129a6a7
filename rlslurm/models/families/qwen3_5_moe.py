"""Qwen3.5 MoE (Qwen3.5-35B-A3B): Qwen3.5 with Qwen3-Next's MoE block in every layer and no dense MLP
(no intermediate_size: the model config keeps the experts' width as ffn_hidden_size); its router
(Qwen3VLMoeTextTopKRouter) always divides by the sum and has no norm_topk_prob field. Experts are
stored per expert, as transformers writes them (docs/model-families.md, "Qwen3.5")."""

from __future__ import annotations

from rlslurm.models.families import qwen3_5, qwen3_next
from rlslurm.models.family import Family, Field, fixed

FAMILY = Family(
    name="qwen3_5_moe",
    fixed=qwen3_next.FIXED,
    fields=(*qwen3_5.FIELDS, Field("ffn_hidden_size", "moe_intermediate_size", write=lambda a: {})),
    blocks=(qwen3_next.GATED_DELTA_NET,
            qwen3_next.moe_block(fixed("moe.router_topk_norm", "(qwen3_5_moe router)", True), lambda a: {})),
    refuse=qwen3_next.refuse,
    to_hf=qwen3_5.to_hf,
    text_config=True,
    hf_prefix=qwen3_5.LANGUAGE_MODEL,
    layer_rules=qwen3_next.layer_rules_for(split_in_proj=True),
    layer_spec=qwen3_next.layer_spec,
    checkpoint_extras=qwen3_5.checkpoint_extras,
)
