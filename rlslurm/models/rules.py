"""The weight mapping's vocabulary: a `Rule` ties one Megatron tensor to the HF tensor(s) it is made
of (convert/mapping.py describes the kinds and applies them); the builders below are the layer parts
several families share. Each family's `layer_rules` (rlslurm/models/families/) assembles its
layers from them.

Megatron names are megatron's *local* layer spec's, after `decoder.layers.{L}.`; `{E}` is an
expert index. HF names are full, `{L}` the layer.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from rlslurm.settings.model_config import ModelConfig

Kind = Literal["plain", "vocab", "qkv", "gate_up", "gdn_in", "concat"]


@dataclasses.dataclass(frozen=True)
class Rule:
    mcore: str               # suffix after `decoder.layers.{L}.`, or a full name for global tensors
    hf: tuple[str, ...]      # full HF names, `{L}` = layer, `{E}` = global expert index
    kind: Kind = "plain"
    expert: bool = False     # a routed expert's tensor (`{E}` in both names)
    # TP split dim under megatron's local spec (None: replicated). The loader/exporter read the
    # real one off the model's parameter; this is for model-free use (`default_targets`).
    tp_dim: int | None = None
    # split over TP section by section (sizes along the TP dim of the full tensor); () = one piece
    sections: tuple[int, ...] = ()
    # `concat`: the HF tensors' sizes along dim 0
    pieces: tuple[int, ...] = ()


P = "model.layers.{L}."


def gqa_attention(mc: ModelConfig, *, qk_norm: bool, qk_norm_tp_dim: int | None = None) -> list[Rule]:
    rules = [
        Rule("input_layernorm.weight", (P + "input_layernorm.weight",)),
        Rule("self_attention.linear_qkv.weight",
             tuple(P + f"self_attn.{x}_proj.weight" for x in "qkv"), "qkv", tp_dim=0),
        Rule("self_attention.linear_proj.weight", (P + "self_attn.o_proj.weight",), tp_dim=1),
    ]
    if mc.arch.add_qkv_bias:  # checked against HF attention_bias
        rules.append(Rule("self_attention.linear_qkv.bias", tuple(P + f"self_attn.{x}_proj.bias" for x in "qkv"), "qkv",
                          tp_dim=0))
    if qk_norm:
        rules += [Rule("self_attention.q_layernorm.weight", (P + "self_attn.q_norm.weight",), tp_dim=qk_norm_tp_dim),
                  Rule("self_attention.k_layernorm.weight", (P + "self_attn.k_norm.weight",), tp_dim=qk_norm_tp_dim)]
    return rules


def mla_attention(mc: ModelConfig) -> list[Rule]:
    s = "self_attention."
    rules = [
        Rule("input_layernorm.weight", (P + "input_layernorm.weight",)),
        Rule(s + "linear_kv_down_proj.weight", (P + "self_attn.kv_a_proj_with_mqa.weight",), tp_dim=0),
        Rule(s + "kv_layernorm.weight", (P + "self_attn.kv_a_layernorm.weight",)),
        Rule(s + "linear_kv_up_proj.weight", (P + "self_attn.kv_b_proj.weight",), tp_dim=0),
        Rule(s + "linear_proj.weight", (P + "self_attn.o_proj.weight",), tp_dim=1),
    ]
    if mc.arch.mla.q_lora_rank:
        rules += [Rule(s + "linear_q_down_proj.weight", (P + "self_attn.q_a_proj.weight",), tp_dim=0),
                  Rule(s + "q_layernorm.weight", (P + "self_attn.q_a_layernorm.weight",)),
                  Rule(s + "linear_q_up_proj.weight", (P + "self_attn.q_b_proj.weight",), tp_dim=0)]
    else:
        rules.append(Rule(s + "linear_q_proj.weight", (P + "self_attn.q_proj.weight",), tp_dim=0))
    return rules


def dense_mlp(hf_prefix: str, mc_prefix: str = "mlp.", fused_gate_up: bool = False) -> list[Rule]:
    gate_up = (hf_prefix + "gate_up_proj.weight",) if fused_gate_up else (
        hf_prefix + "gate_proj.weight", hf_prefix + "up_proj.weight")
    return [Rule(mc_prefix + "linear_fc1.weight", gate_up, "gate_up", tp_dim=0),
            Rule(mc_prefix + "linear_fc2.weight", (hf_prefix + "down_proj.weight",), tp_dim=1)]


def routed_experts(hf_prefix: str) -> list[Rule]:
    """The routed experts' MLPs, HF `<hf_prefix>{E}.gate_proj/up_proj/down_proj`."""
    experts = dense_mlp(hf_prefix + "{E}.", "mlp.experts.local_experts.{E}.")
    return [dataclasses.replace(r, expert=True) for r in experts]


def moe_mlp(mc: ModelConfig) -> list[Rule]:
    m = mc.arch.moe
    rules = [Rule("mlp.router.weight", (P + "mlp.gate.weight",))]
    if m.router_expert_bias:
        rules.append(Rule("mlp.router.expert_bias", (P + "mlp.gate.e_score_correction_bias",)))
    rules += routed_experts(P + "mlp.experts.")
    if m.shared_expert_ffn_hidden_size:
        rules += dense_mlp(P + "mlp.shared_experts.", "mlp.shared_experts.")
    return rules


PRE_MLP_NORM = Rule("pre_mlp_layernorm.weight", (P + "post_attention_layernorm.weight",))


def is_moe_layer(mc: ModelConfig, layer: int) -> bool:
    return mc.arch.moe is not None and layer >= mc.arch.moe.first_k_dense


def dense_or_moe(mc: ModelConfig, layer: int) -> list[Rule]:
    """The MLP of `layer`: routed (and shared) experts from the first MoE layer on, else dense."""
    return moe_mlp(mc) if is_moe_layer(mc, layer) else dense_mlp(P + "mlp.")


def is_linear_attention_layer(mc: ModelConfig, layer: int) -> bool:
    """Qwen3-Next: layer (0-based) is a gated delta net, not full attention (HF layer_types)."""
    d = mc.arch.gated_delta_net
    return d is not None and (layer + 1) % d.full_attention_interval != 0
