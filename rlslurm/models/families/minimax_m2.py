"""MiniMax-M2: q_norm / k_norm are one RMSNorm each over all heads' q (k), before the head split
(transformers' MiniMaxM2Attention builds them num_attention_heads x head_dim and num_key_value_heads x
head_dim wide; models/qk_norm.py), no biases anywhere, rotate_half over the first rotary_dim of each
head; every layer is MoE behind a sigmoid router with its correction bias, no shared expert.

Tensors: GQA whose q/k norms are split over TP by heads like linear_qkv, then Mixtral's expert names
(`block_sparse_moe.experts.E.w1/w3/w2` = gate/up/down, as transformers' conversion_mapping.py gives
minimax_m2 the mixtral rule), the router `block_sparse_moe.gate` and its correction bias
`block_sparse_moe.e_score_correction_bias` beside it (docs/model-families.md, "MiniMax-M2")."""

from __future__ import annotations

from typing import Any

from rlslurm.errors import ConfigError
from rlslurm.models.family import HF, Block, Family, Field, fixed
from rlslurm.models.rules import PRE_MLP_NORM, P, Rule, gqa_attention


def layer_rules(mc, layer: int) -> list:
    moe = P + "block_sparse_moe."
    mlp = [Rule("mlp.router.weight", (moe + "gate.weight",)),
           Rule("mlp.router.expert_bias", (moe + "e_score_correction_bias",)),
           Rule("mlp.experts.local_experts.{E}.linear_fc1.weight", (moe + "experts.{E}.w1.weight",
                                                                   moe + "experts.{E}.w3.weight"),
                "gate_up", expert=True, tp_dim=0),
           Rule("mlp.experts.local_experts.{E}.linear_fc2.weight", (moe + "experts.{E}.w2.weight",),
                expert=True, tp_dim=1)]
    return gqa_attention(mc, qk_norm=True, qk_norm_tp_dim=0) + [PRE_MLP_NORM] + mlp


# config.json switches of the release that transformers' MiniMaxM2 ignores (it always builds what the
# value here says): a config that turns one of them describes a model transformers would not compute
# as written, so it is refused rather than guessed at
IGNORED = {"use_qk_norm": (True, "q_norm/k_norm"), "qk_norm_type": ("per_layer", "one q/k norm over all heads"),
           "scoring_func": ("sigmoid", "sigmoid router scores"),
           "use_routing_bias": (True, "the router's e_score_correction_bias"),
           "shared_intermediate_size": (0, "no shared expert")}


def refuse(hf: HF) -> None:
    for field, (value, what) in IGNORED.items():
        have = hf(field, value)
        if have != value:
            raise ConfigError(f"{hf.name}: HF minimax_m2 config has {field}={have!r}, but transformers' MiniMaxM2 "
                              f"always builds {what} ({field}={value!r}), and so does the mapping")
    kinds = set(hf("attn_type_list") or [1])
    if kinds != {1}:
        raise ConfigError(f"{hf.name}: HF minimax_m2 config has attn_type_list entries {sorted(kinds - {1})} (not "
                          "full attention), which transformers' MiniMaxM2 and the mapping do not build")


# every layer is MoE; intermediate_size is each expert's width; MiniMaxM2TopKRouter divides the
# chosen scores by their sum, unscaled, ungrouped
MOE = Block("moe", "num_local_experts", (
    Field("moe.num_experts", "num_local_experts"),
    Field("moe.router_topk", "num_experts_per_tok"),
    Field("moe.moe_ffn_hidden_size", "intermediate_size"),
    Field("moe.shared_expert_ffn_hidden_size", "shared_intermediate_size", default=0, write=lambda a: {}),
    fixed("moe.first_k_dense", "(minimax_m2: every layer MoE)", 0),
    Field("moe.router_score_function", "scoring_func", default="sigmoid", write=lambda a: {}),
    fixed("moe.router_topk_norm", "(minimax_m2 router)", True),
    fixed("moe.router_scaling_factor", "(minimax_m2 router)", 1.0),
    fixed("moe.router_num_groups", "(minimax_m2 router)", 1),
    fixed("moe.router_group_topk", "(minimax_m2 router)", 1),
    Field("moe.router_expert_bias", "use_routing_bias", default=True, write=lambda a: {}),
))


def to_hf(mc: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """The release's config.json: partial rotary spelt rotary_dim (transformers' MiniMaxM2Config turns it
    into partial_rotary_factor), the switches transformers ignores, no attention_bias field."""
    a = mc.arch
    cfg.pop("attention_bias", None)
    cfg.update(rotary_dim=int(a.kv_channels * a.rotary_percent), **{k: v for k, (v, _) in IGNORED.items()},
               attn_type_list=[1] * a.num_layers)
    return cfg


def layer_spec(mc, block, tcfg, *, vp_stage: int | None, packed: bool) -> None:
    from rlslurm.models.specs import all_heads_qk_norm

    all_heads_qk_norm(mc, block)


FAMILY = Family(
    name="minimax_m2",
    fixed={"qk_layernorm": True, "qk_layernorm_all_heads": True, "add_qkv_bias": False, "add_bias_linear": False,
           "rotary_interleaved": False, "post_self_attn_layernorm": False, "post_mlp_layernorm": False,
           "normalization": "RMSNorm"},
    blocks=(MOE,),
    refuse=refuse,
    to_hf=to_hf,
    layer_rules=layer_rules,
    layer_spec=layer_spec,
)
