"""DeepSeek-V3 (and Moonlight, Kimi-K2): MLA (q/kv LoRA with their norms), first_k_dense dense layers,
then routed experts with a sigmoid router and its correction bias, plus shared experts. megatron's
MLA rope de-interleaves the rope dims itself, which is what HF's rope_interleave=True does, so the
model config says rotary_interleaved: false.

Kimi-K2's config.json is DeepseekV3ForCausalLM under a model_type of its own (so that engines pick
its tool parser): SGLang registers kimi_k2 as DeepseekV3Config and slime converts it as deepseek_v3,
so it is served here as an alias (docs/model-families.md, "Kimi-K2")."""

from __future__ import annotations

from typing import Any

from rlslurm.models.family import Family, Field
from rlslurm.models.rules import PRE_MLP_NORM, dense_or_moe, mla_attention
from rlslurm.models.tables import MLA, MLA_KV_CHANNELS, deepseek_v3_router_fields, refuse_mla, sigmoid_router_moe

MLA_FIXED = {"qk_layernorm": True, "add_qkv_bias": False, "rotary_interleaved": False,
             "post_self_attn_layernorm": False, "post_mlp_layernorm": False, "normalization": "RMSNorm"}


def layer_rules(mc, layer: int) -> list:
    return mla_attention(mc) + [PRE_MLP_NORM] + dense_or_moe(mc, layer)


def to_hf(mc: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """The router fields transformers drops and SGLang reads unguarded (docs/model-families.md, "What
    SGLang 0.5.14 serves on a GPU"); no MTP layers; rope_interleave spelt out."""
    cfg.pop("attention_bias", None)
    cfg.update(num_nextn_predict_layers=0, rope_interleave=True)
    if mc.arch.moe:
        cfg.update(deepseek_v3_router_fields(mc.arch))
    return cfg


FAMILY = Family(
    name="deepseek_v3",
    aliases=("kimi_k2",),
    fixed=MLA_FIXED,
    fields=(MLA_KV_CHANNELS,),
    blocks=(sigmoid_router_moe("deepseek_v3", Field("moe.router_score_function", "scoring_func", default="sigmoid",
                                                    write=lambda a: {})), MLA),
    refuse=refuse_mla,
    to_hf=to_hf,
    layer_rules=layer_rules,
)
