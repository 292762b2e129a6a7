"""Llama 3: GQA, separate gate/up projections, no q/k norm."""

from __future__ import annotations

from rlslurm.models.family import Family
from rlslurm.models.rules import PRE_MLP_NORM, P, dense_mlp, gqa_attention
from rlslurm.models.tables import BIAS


def layer_rules(mc, layer: int) -> list:
    return gqa_attention(mc, qk_norm=False) + [PRE_MLP_NORM] + dense_mlp(P + "mlp.")


FAMILY = Family(
    name="llama",
    fixed={"qk_layernorm": False, "rotary_interleaved": False, "post_self_attn_layernorm": False,
           "post_mlp_layernorm": False, "normalization": "RMSNorm"},
    fields=BIAS,
    layer_rules=layer_rules,
)
