"""Qwen3-Next: hybrid layers, every N-th one gated full attention (q_proj -> [q_h; gate_h] per head,
per-head q/k norms) and the others gated delta nets (models/gated_delta.py); zero-centred norms
(Qwen3NextRMSNorm: x * (1 + weight)); rotate_half over the first partial_rotary_factor of each head;
MoE behind a softmax router with one gated shared expert (docs/model-families.md, "Qwen3-Next").
Qwen3.5 (families/qwen3_5.py, qwen3_5_moe.py) reuses these layers.

Tensors: a gated delta net's `linear_attn.*` -> megatron GatedDeltaNet's in_proj [q;k;v;z;b;a] split
over TP part by part, conv1d [q;k;v] likewise, A_log/dt_bias per value head, the plain-weight output
norm, out_proj; gated full attention's q_proj fused into linear_qkv by `qkv` with the Layout's output
gate. Every other norm's weight is HF's offset from 1, which megatron's zero-centred norms store the
same way. The MoE layers: routed experts under qwen2_moe's names and one shared expert
(`mlp.shared_expert.*`, singular) behind its sigmoid gate (`mlp.shared_expert_gate`, megatron's
`shared_experts.gate_weight`). The MTP tensors (`mtp.*`) have no rule."""

from __future__ import annotations

from typing import Any, Callable

from rlslurm.errors import ConfigError
from rlslurm.models.family import HF, Block, Family, Field, fixed
from rlslurm.models.random_tensors import add_random_tensors
from rlslurm.models.rules import (
    PRE_MLP_NORM,
    P,
    Rule,
    dense_mlp,
    gqa_attention,
    is_linear_attention_layer,
    is_moe_layer,
    routed_experts,
)
from rlslurm.models.tables import ROTARY_PERCENT_ALWAYS

FIXED = {"qk_layernorm": True, "qk_layernorm_all_heads": False, "add_qkv_bias": False, "add_bias_linear": False,
         "rotary_interleaved": False, "post_self_attn_layernorm": False, "post_mlp_layernorm": False,
         "normalization": "RMSNorm", "norm_zero_centered": True, "attention_output_gate": True}


def _in_proj(mc, split: bool) -> Rule:
    d, la, s = mc.arch.gated_delta_net, P + "linear_attn.", "self_attention."
    qk, v, nv = d.num_key_heads * d.key_head_dim, d.num_value_heads * d.value_head_dim, d.num_value_heads
    if split:
        # Qwen3_5GatedDeltaNet: in_proj_qkv ([q; k; v] over all heads, as the conv reads them),
        # in_proj_z, in_proj_b, in_proj_a: megatron's in_proj is their concatenation
        return Rule(s + "in_proj.weight", tuple(la + f"in_proj_{x}.weight" for x in ("qkv", "z", "b", "a")),
                    "concat", tp_dim=0, sections=(qk, qk, v, v, nv, nv), pieces=(2 * qk + v, v, nv, nv))
    return Rule(s + "in_proj.weight", (la + "in_proj_qkvz.weight", la + "in_proj_ba.weight"), "gdn_in",
                tp_dim=0, sections=(qk, qk, v, v, nv, nv))


def _gated_delta_net(mc, split: bool) -> list[Rule]:
    d, la, s = mc.arch.gated_delta_net, P + "linear_attn.", "self_attention."
    qk, v = d.num_key_heads * d.key_head_dim, d.num_value_heads * d.value_head_dim
    return [Rule("input_layernorm.weight", (P + "input_layernorm.weight",)),
            _in_proj(mc, split),
            Rule(s + "conv1d.weight", (la + "conv1d.weight",), tp_dim=0, sections=(qk, qk, v)),
            Rule(s + "A_log", (la + "A_log",), tp_dim=0),
            Rule(s + "dt_bias", (la + "dt_bias",), tp_dim=0),
            Rule(s + "out_norm.weight", (la + "norm.weight",)),
            Rule(s + "out_proj.weight", (la + "out_proj.weight",), tp_dim=1)]


def layer_rules_for(split_in_proj: bool) -> Callable[[Any, int], list[Rule]]:
    """The layer rules, with Qwen3.5's split in_proj (`split_in_proj`) or Qwen3-Next's fused one."""

    def layer_rules(mc, layer: int) -> list[Rule]:
        a = mc.arch
        attn = (_gated_delta_net(mc, split_in_proj) if is_linear_attention_layer(mc, layer)
                else gqa_attention(mc, qk_norm=True))
        if not is_moe_layer(mc, layer):
            return attn + [PRE_MLP_NORM] + dense_mlp(P + "mlp.")
        mlp = [Rule("mlp.router.weight", (P + "mlp.gate.weight",))] + routed_experts(P + "mlp.experts.")
        if a.moe.shared_expert_ffn_hidden_size:
            mlp += dense_mlp(P + "mlp.shared_expert.", "mlp.shared_experts.")
        if a.moe.shared_expert_gate:
            mlp.append(Rule("mlp.shared_experts.gate_weight", (P + "mlp.shared_expert_gate.weight",)))
        return attn + [PRE_MLP_NORM] + mlp

    return layer_rules


def full_attention_interval(mc_name: str, types: list[str]) -> int:
    """The N of an HF `layer_types` list in which exactly every N-th layer is "full_attention" and the
    others "linear_attention" (what HF's full_attention_interval builds and megatron's int
    linear_attention_freq expresses); N > layers when none is. Any other list is refused."""
    n = len(types)
    interval = next((i + 1 for i, t in enumerate(types) if t == "full_attention"), n + 1)
    want = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    if types != want:
        raise ConfigError(f"{mc_name}: HF layer_types {types} is not every N-th layer full attention and "
                          "the others linear_attention, which is all the model config (full_attention_interval) and "
                          "megatron-core's linear_attention_freq express here")
    return interval


def moe_layers(mc_name: str, g: Callable[..., Any]) -> int | None:
    """The leading dense layers of an HF Qwen3-Next (Qwen3NextDecoderLayer: layer i is MoE unless it is
    in mlp_only_layers, num_experts is 0 or (i + 1) % decoder_sparse_step != 0); None when no layer is
    MoE. MoE layers after a dense one are refused: megatron's moe_layer_freq is read as leading dense
    layers here (MoEArch.first_k_dense)."""
    n, only, step = g("num_hidden_layers"), set(g("mlp_only_layers") or []), g("decoder_sparse_step", 1) or 1
    moe = [i not in only and (g("num_experts") or 0) > 0 and (i + 1) % step == 0 for i in range(n)]
    if not any(moe):
        return None
    k = moe.index(True)
    if not all(moe[k:]):
        raise ConfigError(f"{mc_name}: HF qwen3_next mlp_only_layers={sorted(only)} / decoder_sparse_step={step} put "
                          "dense layers between MoE layers; the model config expresses leading dense layers only")
    return k


def refuse(hf: HF) -> None:
    if hf("attention_bias", False):
        raise ConfigError(f"{hf.name}: HF {hf.model_type} config has attention_bias=true, which gives o_proj a bias "
                          "too; megatron-core's add_qkv_bias covers q/k/v only (add_bias_linear would add MLP biases)")
    if hf("attn_output_gate", True) is not True:
        # Qwen3.5's config.json says attn_output_gate; transformers builds the gate whatever it says
        raise ConfigError(f"{hf.name}: HF {hf.model_type} config has attn_output_gate={hf('attn_output_gate')!r}, "
                          "but transformers' Qwen3NextAttention always builds the output gate, and so does the "
                          "mapping")


def _layer_types(a: Any) -> dict[str, Any]:
    d = a.gated_delta_net
    return {"full_attention_interval": d.full_attention_interval,
            "layer_types": ["linear_attention" if (i + 1) % d.full_attention_interval else "full_attention"
                            for i in range(a.num_layers)]}


GATED_DELTA_NET = Block("gated_delta_net", "layer_types", (
    Field("gated_delta_net.full_attention_interval", "layer_types", write=_layer_types,
          read=lambda hf: full_attention_interval(hf.name, list(hf("layer_types") or []))),
    Field("gated_delta_net.conv_kernel_dim", "linear_conv_kernel_dim"),
    Field("gated_delta_net.key_head_dim", "linear_key_head_dim"),
    Field("gated_delta_net.value_head_dim", "linear_value_head_dim"),
    Field("gated_delta_net.num_key_heads", "linear_num_key_heads"),
    Field("gated_delta_net.num_value_heads", "linear_num_value_heads"),
))


def moe_block(topk_norm: Field, first_dense_write: Callable[[Any], dict[str, Any]]) -> Block:
    """Qwen3-Next's MoE: Qwen3NextSparseMoeBlock always builds shared_expert_gate; Qwen3NextTopKRouter:
    softmax, top-k, divided by their sum when norm_topk_prob, no scaling, no groups, no bias."""
    return Block("moe", "num_experts", present=lambda hf: moe_layers(hf.name, hf) is not None, fields=(
        Field("moe.num_experts", "num_experts"),
        Field("moe.router_topk", "num_experts_per_tok"),
        Field("moe.moe_ffn_hidden_size", "moe_intermediate_size"),
        Field("moe.first_k_dense", "mlp_only_layers/decoder_sparse_step", read=lambda hf: moe_layers(hf.name, hf),
              write=first_dense_write),
        Field("moe.shared_expert_ffn_hidden_size", "shared_expert_intermediate_size",
              read=lambda hf: hf("shared_expert_intermediate_size") or 0),
        fixed("moe.shared_expert_gate", "(qwen3_next shared_expert_gate)", True),
        topk_norm,
        fixed("moe.router_score_function", "(qwen3_next router)", "softmax"),
        fixed("moe.router_scaling_factor", "(qwen3_next router)", 1.0),
        fixed("moe.router_num_groups", "(qwen3_next router)", 1),
        fixed("moe.router_expert_bias", "(qwen3_next router)", False),
    ))


def layer_spec(mc, block, tcfg, *, vp_stage: int | None, packed: bool) -> None:
    """The linear-attention layers get megatron-core's GatedDeltaNet (models/specs.py)."""
    if mc.arch.gated_delta_net is not None:
        from rlslurm.models.specs import gated_delta_net_layers

        gated_delta_net_layers(mc, block, tcfg, vp_stage=vp_stage)


def _no_moe(mc: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    if mc.arch.moe is None:
        cfg.update(num_experts=0)
    return cfg


def mtp_shapes(h: int) -> dict[str, tuple[int, ...]]:
    """A few tensors of Qwen3-Next's MTP module, named as the release stores them (SGLang 0.5.23
    qwen3_next.py load_weights reads these names when is_mtp; transformers' Qwen3NextPreTrainedModel
    ignores `^mtp.*` on load)."""
    return {"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
            "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,),
            "mtp.layers.0.input_layernorm.weight": (h,)}


def checkpoint_extras(out: Any, config_json: dict[str, Any], hf_config: Any, dtype: Any, seed: int) -> None:
    """The release's MTP tensors, which no rule maps."""
    add_random_tensors(out, mtp_shapes(hf_config.hidden_size), dtype, seed)


FAMILY = Family(
    name="qwen3_next",
    fixed=FIXED,
    # Qwen3NextConfig's partial_rotary_factor defaults to 0.25, so always spelt out
    fields=(ROTARY_PERCENT_ALWAYS, Field("add_qkv_bias", "attention_bias", compared=False,
                                         read=lambda hf: bool(hf("attention_bias", False)))),
    blocks=(GATED_DELTA_NET, moe_block(
        Field("moe.router_topk_norm", "norm_topk_prob", read=lambda hf: bool(hf("norm_topk_prob", False))),
        lambda a: {"decoder_sparse_step": 1, "mlp_only_layers": list(range(a.moe.first_k_dense))})),
    refuse=refuse,
    to_hf=_no_moe,
    layer_rules=layer_rules_for(split_in_proj=False),
    layer_spec=layer_spec,
    checkpoint_extras=checkpoint_extras,
)
