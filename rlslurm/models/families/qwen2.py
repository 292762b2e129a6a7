"""Qwen2 / Qwen2.5: Llama plus q/k/v biases. Qwen2's attention builds q/k/v with bias=True and o_proj,
MLP without; config.json has no attention_bias/mlp_bias field to read, so the biases are fixed here
(and `gqa_attention` adds the fused linear_qkv bias). The small sizes tie embeddings."""

from __future__ import annotations

from rlslurm.models.family import Family
from rlslurm.models.rules import PRE_MLP_NORM, P, dense_mlp, gqa_attention
from rlslurm.models.tables import no_bias

FIXED = {"qk_layernorm": False, "add_qkv_bias": True, "add_bias_linear": False, "rotary_interleaved": False,
         "post_self_attn_layernorm": False, "post_mlp_layernorm": False, "normalization": "RMSNorm"}


def layer_rules(mc, layer: int) -> list:
    return gqa_attention(mc, qk_norm=False) + [PRE_MLP_NORM] + dense_mlp(P + "mlp.")


FAMILY = Family(name="qwen2", fixed=FIXED, layer_rules=layer_rules, to_hf=no_bias)
