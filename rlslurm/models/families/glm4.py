"""GLM-4-0414: q/k/v bias, gate_up already fused in HF, sandwich norms after attention and MLP, partial
interleaved rotary. The rotary needs no re-layout: megatron's rotary_interleaved with rotary_percent
computes what HF's rotate_half over x[0::2]/x[1::2] does."""

from __future__ import annotations

from rlslurm.models.family import Family
from rlslurm.models.rules import PRE_MLP_NORM, P, Rule, dense_mlp, gqa_attention
from rlslurm.models.tables import BIAS


def layer_rules(mc, layer: int) -> list:
    return (gqa_attention(mc, qk_norm=False) + [PRE_MLP_NORM] + dense_mlp(P + "mlp.", fused_gate_up=True)
            + [Rule("self_attention.post_self_attn_layernorm.weight", (P + "post_self_attn_layernorm.weight",)),
               Rule("mlp.post_mlp_layernorm.weight", (P + "post_mlp_layernorm.weight",))])


def layer_spec(mc, block, tcfg, *, vp_stage: int | None, packed: bool) -> None:
    from rlslurm.models.specs import post_norms

    post_norms(mc, block)


FAMILY = Family(
    name="glm4",
    fixed={"qk_layernorm": False, "rotary_interleaved": True, "post_self_attn_layernorm": True,
           "post_mlp_layernorm": True, "normalization": "RMSNorm"},
    fields=BIAS,
    layer_rules=layer_rules,
    layer_spec=layer_spec,
)
