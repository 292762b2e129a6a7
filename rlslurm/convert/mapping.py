"""The one HF <-> Megatron mapping: a small explicit table per family, and the re-layouts.

Three users share it: the trainer's HF load (`hf_to_mcore`, sharded for this rank), the weight
sync's export (`rlslurm.convert.export.mcore_to_hf`, gathered to full HF tensors), and the
checkpoint converter (`rlslurm convert`).

A `Rule` ties one Megatron tensor (named as in megatron's *local* layer spec, with `{E}` for an
expert index) to the HF tensor(s) it is made of, and says how they are laid out:

- `plain`: same tensor. Whether and along which dim it is split over TP is read from the
  Megatron parameter itself (`tensor_model_parallel`, `partition_dim`), so a layer that is
  duplicated under transformer-engine and column-parallel under the local spec (MLA's down
  projections) needs no second table.
- `vocab`: embedding / output layer: padded with zero rows to the TP-padded vocabulary on import,
  trimmed on export; split over TP along dim 0.
- `qkv`: HF q/k/v (weights or biases) fused into Megatron's `linear_qkv`, grouped by query group
  (`[q heads of group g, k_g, v_g]` for every g); the TP split is contiguous over groups.
- `gate_up`: HF gate and up (two tensors, or GLM-4's one fused `gate_up_proj`) concatenated into
  `linear_fc1`; for TP every rank holds `[gate_r; up_r]`, not a contiguous chunk.
- `gdn_in`: Qwen3-Next's gated delta net input projection: HF `in_proj_qkvz` and `in_proj_ba`, both
  grouped by key head, re-laid out as megatron's `in_proj` `[q; k; v; z; b; a]`, each part over all
  heads.
- `concat`: HF tensors concatenated along dim 0 as they are (Qwen3.5's `in_proj_qkv`, `in_proj_z`,
  `in_proj_b`, `in_proj_a` -> the same `in_proj`); `Rule.pieces` gives their sizes for the way back.

A vision-language model's language model (Qwen3.5) has its HF tensors under `model.language_model.`
instead of `model.` (LANGUAGE_MODEL_PREFIX); the rules are the same.

A rule with `sections` is split over TP section by section (every rank holds `[s1_r; s2_r; ...]`,
as megatron's GatedDeltaNet splits its fused in_proj and conv1d), not in one contiguous chunk. With
an attention output gate (Qwen3-Next, `Layout.output_gate`), HF's q_proj holds `[q_h; gate_h]` per
head and `qkv` puts `[q heads of g, gate heads of g, k_g, v_g]` per query group, as megatron's
`attention_output_gate` reads linear_qkv.

Layer indices in the yielded Megatron names are global (0-based), like HF's; the loader maps them
to a pipeline stage's local layers. Expert indices are local to this EP rank.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterable, Iterator, Literal

import torch

from rlslurm.errors import ConfigError, DataError
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
# model_type -> where its language model's tensors are (default "model.")
LANGUAGE_MODEL_PREFIX = {"qwen3_5": "model.language_model.", "qwen3_5_moe": "model.language_model."}


def _under(mc: ModelConfig, rules: list[Rule]) -> list[Rule]:
    """`rules` with their HF names moved under the family's language-model prefix."""
    prefix = LANGUAGE_MODEL_PREFIX.get(mc.hf_model_type)
    if prefix is None:
        return rules
    return [dataclasses.replace(r, hf=tuple(prefix + h.removeprefix("model.") if h.startswith("model.") else h
                                             for h in r.hf)) for r in rules]


def _global_rules(mc: ModelConfig) -> list[Rule]:
    rules = [
        Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", tp_dim=0),
        Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    ]
    # Tied: a last pipeline stage still holds an `output_layer.weight` (megatron keeps it in sync
    # with the embedding); it loads from the embedding and is never exported (`lm_head` is absent).
    head = "model.embed_tokens.weight" if mc.arch.tie_word_embeddings else "lm_head.weight"
    rules.append(Rule("output_layer.weight", (head,), "vocab", tp_dim=0))
    return _under(mc, rules)


def _gqa_attention(mc: ModelConfig, *, qk_norm: bool, qk_norm_tp_dim: int | None = None) -> list[Rule]:
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


def _mla_attention(mc: ModelConfig) -> list[Rule]:
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


def _dense_mlp(hf_prefix: str, mc_prefix: str = "mlp.", fused_gate_up: bool = False) -> list[Rule]:
    gate_up = (hf_prefix + "gate_up_proj.weight",) if fused_gate_up else (
        hf_prefix + "gate_proj.weight", hf_prefix + "up_proj.weight")
    return [Rule(mc_prefix + "linear_fc1.weight", gate_up, "gate_up", tp_dim=0),
            Rule(mc_prefix + "linear_fc2.weight", (hf_prefix + "down_proj.weight",), tp_dim=1)]


def _moe_mlp(mc: ModelConfig) -> list[Rule]:
    m = mc.arch.moe
    rules = [Rule("mlp.router.weight", (P + "mlp.gate.weight",))]
    if m.router_expert_bias:
        rules.append(Rule("mlp.router.expert_bias", (P + "mlp.gate.e_score_correction_bias",)))
    rules += [dataclasses.replace(r, expert=True)
              for r in _dense_mlp(P + "mlp.experts.{E}.", "mlp.experts.local_experts.{E}.")]
    if m.shared_expert_ffn_hidden_size:
        rules += _dense_mlp(P + "mlp.shared_experts.", "mlp.shared_experts.")
    return rules


_PRE_MLP_NORM = Rule("pre_mlp_layernorm.weight", (P + "post_attention_layernorm.weight",))


def _is_moe_layer(mc: ModelConfig, layer: int) -> bool:
    return mc.arch.moe is not None and layer >= mc.arch.moe.first_k_dense


# ------------------------------------------------------------------ one table per family


def _llama(mc: ModelConfig, layer: int) -> list[Rule]:
    """Llama 3: GQA, separate gate/up projections."""
    return _gqa_attention(mc, qk_norm=False) + [_PRE_MLP_NORM] + _dense_mlp(P + "mlp.")


def _qwen2(mc: ModelConfig, layer: int) -> list[Rule]:
    """Qwen2 / Qwen2.5: Llama plus q/k/v biases (HF hard-codes them, so hf_config.FAMILY_FIXED
    holds arch.add_qkv_bias true and `_gqa_attention` adds the fused linear_qkv bias); o_proj and
    the MLP have none, and there is no q/k norm. The small sizes tie embeddings (`_global_rules`)."""
    return _gqa_attention(mc, qk_norm=False) + [_PRE_MLP_NORM] + _dense_mlp(P + "mlp.")


def _qwen3(mc: ModelConfig, layer: int) -> list[Rule]:
    """Qwen3 dense: Llama plus per-head q/k RMSNorm."""
    return _gqa_attention(mc, qk_norm=True) + [_PRE_MLP_NORM] + _dense_mlp(P + "mlp.")


def _glm4(mc: ModelConfig, layer: int) -> list[Rule]:
    """GLM-4-0414: qkv bias, gate_up already fused in HF, sandwich norms after attention and MLP.
    (Its partial interleaved rotary needs no re-layout: megatron's rotary_interleaved with
    rotary_percent computes what HF's rotate_half over x[0::2]/x[1::2] does.)"""
    return (_gqa_attention(mc, qk_norm=False) + [_PRE_MLP_NORM] + _dense_mlp(P + "mlp.", fused_gate_up=True)
            + [Rule("self_attention.post_self_attn_layernorm.weight", (P + "post_self_attn_layernorm.weight",)),
               Rule("mlp.post_mlp_layernorm.weight", (P + "post_mlp_layernorm.weight",))])


def _qwen3_moe(mc: ModelConfig, layer: int) -> list[Rule]:
    """Qwen3-MoE: Qwen3 attention, routed experts (softmax router), no shared expert."""
    mlp = _moe_mlp(mc) if _is_moe_layer(mc, layer) else _dense_mlp(P + "mlp.")
    return _gqa_attention(mc, qk_norm=True) + [_PRE_MLP_NORM] + mlp


def _deepseek_v3(mc: ModelConfig, layer: int) -> list[Rule]:
    """DeepSeek-V3: MLA (q/kv LoRA with their norms), first_k_dense dense layers, then routed
    experts with a sigmoid router and its correction bias, plus shared experts."""
    mlp = _moe_mlp(mc) if _is_moe_layer(mc, layer) else _dense_mlp(P + "mlp.")
    return _mla_attention(mc) + [_PRE_MLP_NORM] + mlp


def _glm4_moe(mc: ModelConfig, layer: int) -> list[Rule]:
    """GLM-4.5 (MoE): GQA with q/k/v biases, per-head q/k norm only where config.json says
    use_qk_norm (the 355B model; Air has none), partial non-interleaved rotary (no re-layout:
    megatron rotates the first rotary_percent of each head as HF does); first_k_dense dense layers
    with separate gate/up, then routed experts with a sigmoid router and its correction bias plus
    shared experts, named as DeepSeek-V3's. The MTP layer that released checkpoints append
    (`model.layers.{num_layers}.*`) has no rule: never loaded, trained or exported
    (docs/model-families.md)."""
    mlp = _moe_mlp(mc) if _is_moe_layer(mc, layer) else _dense_mlp(P + "mlp.")
    return _gqa_attention(mc, qk_norm=mc.arch.qk_layernorm) + [_PRE_MLP_NORM] + mlp


def _glm4_moe_lite(mc: ModelConfig, layer: int) -> list[Rule]:
    """GLM-4.7-Flash: DeepSeek-V3's tensors under DeepSeek-V3's names (transformers'
    Glm4MoeLiteAttention is DeepseekV3Attention, its MoE GLM-4.5's, named as DeepSeek-V3's); the
    dense layers are those mlp_layer_types says (arch.moe.first_k_dense). The MTP layer released
    checkpoints append (`model.layers.{num_layers}.*`) has no rule, as for glm4_moe."""
    return _deepseek_v3(mc, layer)


def _minimax_m2(mc: ModelConfig, layer: int) -> list[Rule]:
    """MiniMax-M2: GQA without biases whose q_norm/k_norm span all heads ([heads x head_dim] and
    [kv heads x head_dim], split over TP by heads like linear_qkv: models/qk_norm.py), then routed
    experts only, Mixtral's checkpoint names (`block_sparse_moe.experts.E.w1/w3/w2` = gate/up/down,
    as transformers' conversion_mapping.py gives minimax_m2 the mixtral rule), a sigmoid router
    `block_sparse_moe.gate` and its correction bias `block_sparse_moe.e_score_correction_bias`
    beside it, not in the gate (docs/model-families.md)."""
    moe = P + "block_sparse_moe."
    mlp = [Rule("mlp.router.weight", (moe + "gate.weight",)),
           Rule("mlp.router.expert_bias", (moe + "e_score_correction_bias",)),
           Rule("mlp.experts.local_experts.{E}.linear_fc1.weight", (moe + "experts.{E}.w1.weight",
                                                                   moe + "experts.{E}.w3.weight"),
                "gate_up", expert=True, tp_dim=0),
           Rule("mlp.experts.local_experts.{E}.linear_fc2.weight", (moe + "experts.{E}.w2.weight",),
                expert=True, tp_dim=1)]
    return _gqa_attention(mc, qk_norm=True, qk_norm_tp_dim=0) + [_PRE_MLP_NORM] + mlp


def _glm_moe_dsa(mc: ModelConfig, layer: int) -> list[Rule]:
    """GLM-5: GLM-4.7-Flash's tensors (DeepSeek-V3's MLA and MoE names) plus, in every layer, the
    sparse-attention indexer (`self_attn.indexer.*`: wq_b from the query latent, wk, the k LayerNorm's
    weight and bias, weights_proj), replicated over TP and laid out as transformers' (rotary part
    first: models/dsa.py rotates it there, so no permutation); GLM-5.2's shared layers have none. The
    MTP layer of the release (`model.layers.{num_layers}.*`) has no rule, as for glm4_moe
    (docs/model-families.md, "GLM-5")."""
    i, hf = "self_attention.core_attention.indexer.", P + "self_attn.indexer."
    indexer = [Rule(i + "linear_wq_b.weight", (hf + "wq_b.weight",)), Rule(i + "linear_wk.weight", (hf + "wk.weight",)),
               Rule(i + "k_norm.weight", (hf + "k_norm.weight",)), Rule(i + "k_norm.bias", (hf + "k_norm.bias",)),
               Rule(i + "linear_weights_proj.weight", (hf + "weights_proj.weight",))]
    if layer in mc.arch.dsa.shared_layers:  # GLM-5.2: no indexer, the top-k of an earlier layer
        return _deepseek_v3(mc, layer)
    return _deepseek_v3(mc, layer) + indexer


def _mimo(mc: ModelConfig, layer: int) -> list[Rule]:
    """Xiaomi MiMo-7B: the main model is Qwen2's, tensor for tensor (SGLang's MiMoModel is its
    Qwen2Model). `model.mtp_layers.*` has no rule: never loaded, trained or exported; the engine's
    MTP drafter keeps the checkpoint's (docs/model-families.md)."""
    return _qwen2(mc, layer)


def is_linear_attention_layer(mc: ModelConfig, layer: int) -> bool:
    """Qwen3-Next: layer (0-based) is a gated delta net, not full attention (HF layer_types)."""
    d = mc.arch.gated_delta_net
    return d is not None and (layer + 1) % d.full_attention_interval != 0


def _qwen3_next(mc: ModelConfig, layer: int) -> list[Rule]:
    """Qwen3-Next (docs/model-families.md, "Qwen3-Next"): per layer either a gated delta net
    (`linear_attn.*` -> megatron GatedDeltaNet's in_proj [q;k;v;z;b;a] split over TP part by part,
    conv1d [q;k;v] likewise, A_log/dt_bias per value head, the plain-weight output norm, out_proj) or
    gated full attention (q_proj holds [q_h; gate_h] per head, fused into linear_qkv by `qkv` with
    the Layout's output gate; per-head q/k norms). Every other norm's weight is HF's offset from 1,
    which megatron's zero-centred norms store the same way: no conversion. The MoE layers have a
    softmax router, routed experts under qwen2_moe's names, and one shared expert
    (`mlp.shared_expert.*`, singular) behind its own sigmoid gate (`mlp.shared_expert_gate`, megatron's
    `shared_experts.gate_weight`). The MTP tensors (`mtp.*`) have no rule: never loaded, trained or
    exported."""
    a = mc.arch
    if is_linear_attention_layer(mc, layer):
        d, la, s = a.gated_delta_net, P + "linear_attn.", "self_attention."
        qk, v, nv = d.num_key_heads * d.key_head_dim, d.num_value_heads * d.value_head_dim, d.num_value_heads
        if mc.hf_model_type in ("qwen3_5", "qwen3_5_moe"):
            # Qwen3_5GatedDeltaNet: in_proj_qkv ([q; k; v] over all heads, as the conv reads them),
            # in_proj_z, in_proj_b, in_proj_a: megatron's in_proj is their concatenation
            in_proj = Rule(s + "in_proj.weight", tuple(la + f"in_proj_{x}.weight" for x in ("qkv", "z", "b", "a")),
                           "concat", tp_dim=0, sections=(qk, qk, v, v, nv, nv), pieces=(2 * qk + v, v, nv, nv))
        else:
            in_proj = Rule(s + "in_proj.weight", (la + "in_proj_qkvz.weight", la + "in_proj_ba.weight"), "gdn_in",
                           tp_dim=0, sections=(qk, qk, v, v, nv, nv))
        attn = [Rule("input_layernorm.weight", (P + "input_layernorm.weight",)),
                in_proj,
                Rule(s + "conv1d.weight", (la + "conv1d.weight",), tp_dim=0, sections=(qk, qk, v)),
                Rule(s + "A_log", (la + "A_log",), tp_dim=0),
                Rule(s + "dt_bias", (la + "dt_bias",), tp_dim=0),
                Rule(s + "out_norm.weight", (la + "norm.weight",)),
                Rule(s + "out_proj.weight", (la + "out_proj.weight",), tp_dim=1)]
    else:
        attn = _gqa_attention(mc, qk_norm=True)
    if not _is_moe_layer(mc, layer):
        return attn + [_PRE_MLP_NORM] + _dense_mlp(P + "mlp.")
    mlp = [Rule("mlp.router.weight", (P + "mlp.gate.weight",))]
    mlp += [dataclasses.replace(r, expert=True)
            for r in _dense_mlp(P + "mlp.experts.{E}.", "mlp.experts.local_experts.{E}.")]
    if a.moe.shared_expert_ffn_hidden_size:
        mlp += _dense_mlp(P + "mlp.shared_expert.", "mlp.shared_experts.")
    if a.moe.shared_expert_gate:
        mlp.append(Rule("mlp.shared_experts.gate_weight", (P + "mlp.shared_expert_gate.weight",)))
    return attn + [_PRE_MLP_NORM] + mlp


FAMILIES: dict[str, Callable[[ModelConfig, int], list[Rule]]] = {
    "llama": _llama,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "glm4": _glm4,
    "qwen3_moe": _qwen3_moe,
    "deepseek_v3": _deepseek_v3,
    "glm4_moe": _glm4_moe,
    "glm4_moe_lite": _glm4_moe_lite,
    "mimo": _mimo,
    "minimax_m2": _minimax_m2,
    "qwen3_next": _qwen3_next,
    # Qwen3.5's language model: Qwen3-Next's layers with the split in_proj and a dense MLP (arch.moe
    # None), under model.language_model. (LANGUAGE_MODEL_PREFIX); model.visual.* has no rule
    "qwen3_5": _qwen3_next,
    # Qwen3.5 MoE: the same with Qwen3-Next's MoE block in every layer (experts per expert, as
    # transformers 5.19 writes them)
    "qwen3_5_moe": _qwen3_next,
    "glm_moe_dsa": _glm_moe_dsa,
}


def layer_rules(mc: ModelConfig, layer: int) -> list[Rule]:
    """The rules of decoder layer `layer` (0-based, global) for mc's family."""
    family = FAMILIES.get(mc.hf_model_type)
    if family is None:
        raise ConfigError(f"model config {mc.name}: hf_model_type={mc.hf_model_type!r} has no HF<->Megatron "
                          f"mapping; supported: {', '.join(FAMILIES)}")
    return _under(mc, family(mc, layer))


# Megatron's transformer-engine spec fuses the pre-attention/pre-MLP norms into the following
# linear; its parameter names differ from the local spec's (docs/megatron-cpu.md,
# "Transformer-engine parameter names").
TE_ALIASES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
    "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight",
}
# TE name -> local name where a local name has a second TE name: a gated delta net layer's input norm
# is fused into its in_proj (megatron's get_gated_delta_net_module_spec), not into linear_qkv
TE_REVERSE_EXTRA = {"self_attention.in_proj.layer_norm_weight": "input_layernorm.weight"}

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"local_experts\.(\d+)\.")


def fmt(pattern: str, layer: int | None = None, expert: int | None = None) -> str:
    return pattern.replace("{L}", str(layer)).replace("{E}", str(expert))


# ------------------------------------------------------------------ re-layouts (pure functions)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int, *,
             output_gate: bool = False) -> torch.Tensor:
    """HF q/k/v (weights [n*d, h] or biases [n*d]) -> Megatron linear_qkv, grouped by query group.
    `output_gate`: HF's q holds [q_h; gate_h] per head (Qwen3-Next), megatron wants [q heads of g,
    gate heads of g, k_g, v_g] per group (attention.py get_query_key_value_tensors)."""
    tail = q.shape[1:]
    kg = k.reshape(groups, -1, *tail)
    vg = v.reshape(groups, -1, *tail)
    if output_gate:
        head_dim = kg.shape[1]
        pairs = q.reshape(-1, 2, head_dim, *tail)  # [heads, (q, gate), d, ...]
        qg = pairs[:, 0].reshape(groups, -1, *tail)
        gg = pairs[:, 1].reshape(groups, -1, *tail)
        return torch.cat([qg, gg, kg, vg], dim=1).reshape(-1, *tail)
    qg = q.reshape(groups, -1, *tail)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *tail)


def split_qkv(fused: torch.Tensor, groups: int, heads: int, head_dim: int, *,
              output_gate: bool = False) -> tuple[torch.Tensor, ...]:
    tail = fused.shape[1:]
    per_group = heads // groups * head_dim
    if output_gate:
        g = fused.reshape(groups, 2 * per_group + 2 * head_dim, *tail)
        q, gate, k, v = torch.split(g, [per_group, per_group, head_dim, head_dim], dim=1)
        q = torch.stack([q.reshape(heads, head_dim, *tail), gate.reshape(heads, head_dim, *tail)], dim=1)
        return tuple(x.reshape(-1, *tail).contiguous() for x in (q, k, v))
    g = fused.reshape(groups, per_group + 2 * head_dim, *tail)
    q, k, v = torch.split(g, [per_group, head_dim, head_dim], dim=1)
    return tuple(x.reshape(-1, *tail).contiguous() for x in (q, k, v))


def fuse_gdn_in(qkvz: torch.Tensor, ba: torch.Tensor, key_heads: int, key_dim: int, value_heads: int,
                value_dim: int) -> torch.Tensor:
    """HF Qwen3-Next `in_proj_qkvz` ([q_g, k_g, v_g, z_g] per key head g, v_g/z_g the g-th group of
    value_heads / key_heads value heads) and `in_proj_ba` ([b_g, a_g] per key head;
    Qwen3NextGatedDeltaNet.fix_query_key_value_ordering) -> megatron GatedDeltaNet's in_proj
    [q; k; v; z; b; a], each over all heads in head order."""
    r = value_heads // key_heads
    tail = qkvz.shape[1:]
    q, k, v, z = torch.split(qkvz.reshape(key_heads, -1, *tail), [key_dim, key_dim, r * value_dim, r * value_dim], 1)
    b, a = torch.split(ba.reshape(key_heads, 2 * r, *tail), [r, r], 1)
    return torch.cat([x.reshape(-1, *tail) for x in (q, k, v, z, b, a)], 0)


def split_gdn_in(full: torch.Tensor, key_heads: int, key_dim: int, value_heads: int,
                 value_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_gdn_in`."""
    r = value_heads // key_heads
    tail = full.shape[1:]
    qk, v = key_heads * key_dim, value_heads * value_dim
    q, k, vv, z, b, a = torch.split(full, [qk, qk, v, v, value_heads, value_heads], 0)
    per_head = [x.reshape(key_heads, -1, *tail) for x in (q, k, vv, z)]
    qkvz = torch.cat(per_head, 1).reshape(-1, *tail)
    ba = torch.cat([b.reshape(key_heads, r, *tail), a.reshape(key_heads, r, *tail)], 1).reshape(-1, *tail)
    return qkvz.contiguous(), ba.contiguous()


def _halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = t.shape[0] // 2
    return t[:n], t[n:]


def shard(kind: Kind, full: torch.Tensor, rank: int, size: int, *, partition_dim: int | None,
          sections: tuple[int, ...] = ()) -> torch.Tensor:
    """This TP rank's slice of a full Megatron-layout tensor. partition_dim None = replicated.
    `sections`: split each section over TP and concatenate this rank's pieces (Rule.sections)."""
    if size == 1 or partition_dim is None:
        return full
    if sections:
        if any(n % size for n in sections) or sum(sections) != full.shape[partition_dim]:
            raise ConfigError(f"cannot split sections {sections} of a tensor of shape {tuple(full.shape)} along dim "
                              f"{partition_dim} into {size} TP shards")
        parts = torch.split(full, list(sections), partition_dim)
        return torch.cat([p.chunk(size, partition_dim)[rank] for p in parts], partition_dim)
    if kind == "gate_up":
        gate, up = _halves(full)
        return torch.cat([gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank]], 0)
    if full.shape[partition_dim] % size:
        raise ConfigError(f"cannot split a tensor of shape {tuple(full.shape)} along dim {partition_dim} "
                          f"into {size} TP shards")
    return full.chunk(size, partition_dim)[rank]


def unshard(kind: Kind, parts: list[torch.Tensor], *, partition_dim: int | None,
            sections: tuple[int, ...] = ()) -> torch.Tensor:
    """Inverse of `shard` given every TP rank's slice in rank order."""
    if len(parts) == 1 or partition_dim is None:
        return parts[0]
    if sections:
        local = [n // len(parts) for n in sections]
        pieces = [torch.split(p, local, partition_dim) for p in parts]
        return torch.cat([pieces[r][i] for i in range(len(sections)) for r in range(len(parts))], partition_dim)
    if kind == "gate_up":
        halves = [_halves(p) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
    return torch.cat(parts, partition_dim)


@dataclasses.dataclass(frozen=True)
class Layout:
    """The numbers the re-layouts need."""

    heads: int
    groups: int
    head_dim: int
    vocab: int
    vocab_padded: int
    output_gate: bool = False
    # gated delta net: key heads, key head dim, value heads, value head dim (0: none)
    gdn: tuple[int, int, int, int] = (0, 0, 0, 0)

    @classmethod
    def of(cls, mc: ModelConfig, vocab_padded: int | None = None) -> "Layout":
        a = mc.arch
        d = a.gated_delta_net
        gdn = (d.num_key_heads, d.key_head_dim, d.num_value_heads, d.value_head_dim) if d else (0, 0, 0, 0)
        return cls(a.num_attention_heads, a.num_query_groups, a.kv_channels, a.vocab_size,
                   vocab_padded or a.vocab_size, a.attention_output_gate, gdn)


def to_mcore(rule: Rule, hf: list[torch.Tensor], lay: Layout) -> torch.Tensor:
    """HF tensor(s) of `rule` -> the full (unsharded) Megatron tensor."""
    if rule.kind == "plain":
        return hf[0]
    if rule.kind == "vocab":
        t = hf[0]
        if t.shape[0] != lay.vocab:
            raise DataError(rule.hf[0], f"has {t.shape[0]} rows, model config vocab_size={lay.vocab}")
        if lay.vocab_padded > lay.vocab:
            t = torch.cat([t, t.new_zeros(lay.vocab_padded - lay.vocab, *t.shape[1:])], 0)
        return t
    if rule.kind == "qkv":
        return fuse_qkv(*hf, groups=lay.groups, output_gate=lay.output_gate)
    if rule.kind == "gdn_in":
        return fuse_gdn_in(*hf, *lay.gdn)
    if rule.kind == "concat":
        return torch.cat(hf, 0)
    if rule.kind == "gate_up":
        return hf[0] if len(hf) == 1 else torch.cat(hf, 0)
    raise AssertionError(rule.kind)


def to_hf(rule: Rule, full: torch.Tensor, lay: Layout) -> list[torch.Tensor]:
    """The full Megatron tensor of `rule` -> its HF tensor(s), in `rule.hf` order."""
    if rule.kind == "plain":
        return [full]
    if rule.kind == "vocab":
        return [full[: lay.vocab]]
    if rule.kind == "qkv":
        return list(split_qkv(full, lay.groups, lay.heads, lay.head_dim, output_gate=lay.output_gate))
    if rule.kind == "gdn_in":
        return list(split_gdn_in(full, *lay.gdn))
    if rule.kind == "concat":
        return [x.contiguous() for x in torch.split(full, list(rule.pieces), 0)]
    if rule.kind == "gate_up":
        return [full] if len(rule.hf) == 1 else [x.contiguous() for x in _halves(full)]
    raise AssertionError(rule.kind)


# ------------------------------------------------------------------ name resolution


@dataclasses.dataclass(frozen=True)
class Resolved:
    rule: Rule
    layer: int | None       # global layer index
    expert: int | None      # global expert index
    hf_names: tuple[str, ...]


def resolve(mc: ModelConfig, mcore_name: str, *, layer_map: Callable[[int], int] = lambda i: i,
            expert_offset: int = 0) -> Resolved | None:
    """The rule for a Megatron parameter name (local spec or TE names); None if unmapped.

    `layer_map` turns the name's (stage-local) layer index into the global one; `expert_offset`
    is this EP rank's first global expert.
    """
    for r in _global_rules(mc):
        if r.mcore == mcore_name:
            return Resolved(r, None, None, r.hf)
    m = _LAYER_RE.match(mcore_name)
    if not m:
        return None
    layer = layer_map(int(m.group(1)))
    suffix = m.group(2)
    expert = None
    em = _EXPERT_RE.search(suffix)
    if em:
        expert = expert_offset + int(em.group(1))
        suffix = _EXPERT_RE.sub("local_experts.{E}.", suffix, count=1)
    te_reverse = {**{v: k for k, v in TE_ALIASES.items()}, **TE_REVERSE_EXTRA}
    suffix = te_reverse.get(suffix, suffix)
    for r in layer_rules(mc, layer):
        if r.mcore == suffix:
            return Resolved(r, layer, expert, tuple(fmt(h, layer, expert) for h in r.hf))
    return None


def default_targets(mc: ModelConfig, *, num_local_experts: int | None = None) -> dict[str, int | None]:
    """Every Megatron tensor name of a whole (PP=1, EP=1 unless told) local-spec model -> TP dim.

    For model-free use of `hf_to_mcore` (tests, tools); a live model's own names and split dims
    (`load.load_hf_checkpoint`) take precedence where a model exists.
    """
    out: dict[str, int | None] = {}
    for r in _global_rules(mc):
        if r.mcore == "output_layer.weight" and mc.arch.tie_word_embeddings:
            continue
        out[r.mcore] = r.tp_dim
    for layer in range(mc.arch.num_layers):
        for r in layer_rules(mc, layer):
            n = num_local_experts if num_local_experts is not None else (mc.arch.moe.num_experts if r.expert else 0)
            for e in (range(n) if r.expert else [None]):
                out[f"decoder.layers.{layer}." + fmt(r.mcore, layer, e)] = r.tp_dim
    return out


def expected_hf_names(mc: ModelConfig) -> list[str]:
    """Every HF tensor name the mapping reads for `mc` (for completeness checks)."""
    names = list(dict.fromkeys(h for r in _global_rules(mc) for h in r.hf))
    for layer in range(mc.arch.num_layers):
        for r in layer_rules(mc, layer):
            experts = range(mc.arch.moe.num_experts) if r.expert else [None]
            names += [fmt(h, layer, e) for e in experts for h in r.hf]
    return names


# ------------------------------------------------------------------ streaming import


def hf_to_mcore(
    mc: ModelConfig,
    hf_state: Iterable[tuple[str, torch.Tensor]] | Callable[[str], torch.Tensor],
    tp_rank: int = 0,
    tp_size: int = 1,
    *,
    targets: dict[str, int | None] | None = None,
    vocab_size_padded: int | None = None,
    layer_map: Callable[[int], int] = lambda i: i,
    expert_offset: int = 0,
    tp_override: dict[str, tuple[int, int]] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(megatron_name, local_shard)` for every name in `targets`.

    `targets` maps this rank's Megatron parameter names (as in `model.state_dict()`) to their TP
    partition dim (None: replicated); `load.load_hf_checkpoint` reads them off the model. Default:
    `default_targets(mc)` (whole model, local-spec split dims).
    `hf_state` is either a getter `name -> tensor` (random access: each tensor read once, when
    needed) or an iterator of `(hf_name, tensor)` pairs (streaming: tensors are held only until
    every input of a rule has arrived). `tp_override` gives (rank, size) per name where the TP group
    differs (routed experts under expert tensor parallelism).
    """
    lay = Layout.of(mc, vocab_size_padded)
    if targets is None:
        targets = default_targets(mc)
    plan: dict[str, Resolved] = {}
    for name in targets:
        res = resolve(mc, name, layer_map=layer_map, expert_offset=expert_offset)
        if res is None:
            raise ConfigError(f"model config {mc.name}: Megatron parameter {name!r} has no HF mapping "
                              f"for family {mc.hf_model_type!r} (model built for another architecture?)")
        plan[name] = res

    def emit(name: str, tensors: list[torch.Tensor]) -> tuple[str, torch.Tensor]:
        res = plan[name]
        full = to_mcore(res.rule, tensors, lay)
        rank, size = (tp_override or {}).get(name, (tp_rank, tp_size))
        return name, shard(res.rule.kind, full, rank, size, partition_dim=targets[name], sections=res.rule.sections)

    if callable(hf_state):
        for name, res in plan.items():
            yield emit(name, [hf_state(h) for h in res.hf_names])
        return

    waiting: dict[str, list[str]] = {}  # hf name -> megatron names that need it
    for name, res in plan.items():
        for h in res.hf_names:
            waiting.setdefault(h, []).append(name)
    have: dict[str, torch.Tensor] = {}
    remaining = {name: set(res.hf_names) for name, res in plan.items()}
    for hf_name, tensor in hf_state:
        users = waiting.get(hf_name)
        if not users:
            continue  # another stage's / EP rank's tensor, or one the model does not use (MTP)
        have[hf_name] = tensor
        for name in users:
            remaining[name].discard(hf_name)
            if not remaining[name]:
                yield emit(name, [have[h] for h in plan[name].hf_names])
                del remaining[name]
                for h in plan[name].hf_names:
                    waiting[h].remove(name)
                    if not waiting[h]:
                        have.pop(h, None)
    if remaining:
        missing = sorted({h for hs in remaining.values() for h in hs})
        raise DataError("HF checkpoint", f"{len(missing)} tensor(s) missing, e.g. {missing[:5]}")
