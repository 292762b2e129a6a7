"""GLM-5: GLM-4.7-Flash's MLA and MoE plus DeepSeek sparse attention's indexer in every layer
(transformers' GlmMoeDsaAttention/GlmMoeDsaIndexer; models/dsa.py); GLM-5.2's "shared" layers reuse
the top-k of the last "full" layer before them and have no indexer. The indexer's tensors
(`self_attn.indexer.*`: wq_b from the query latent, wk, the k LayerNorm's weight and bias,
weights_proj) are replicated over TP and laid out as transformers' (rotary part first: models/dsa.py
rotates it there, so no permutation). The MTP layer of the release has no rule
(docs/model-families.md, "GLM-5")."""

from __future__ import annotations

from typing import Any

from rlslurm.errors import ConfigError
from rlslurm.models.families import deepseek_v3
from rlslurm.models.family import HF, Block, Family, Field, fixed
from rlslurm.models.rules import P, Rule
from rlslurm.models.tables import MLA, MLA_KV_CHANNELS, deepseek_v3_router_fields, refuse_mla, sigmoid_router_moe


def layer_rules(mc, layer: int) -> list:
    i, hf = "self_attention.core_attention.indexer.", P + "self_attn.indexer."
    indexer = [Rule(i + "linear_wq_b.weight", (hf + "wq_b.weight",)), Rule(i + "linear_wk.weight", (hf + "wk.weight",)),
               Rule(i + "k_norm.weight", (hf + "k_norm.weight",)), Rule(i + "k_norm.bias", (hf + "k_norm.bias",)),
               Rule(i + "linear_weights_proj.weight", (hf + "weights_proj.weight",))]
    if layer in mc.arch.dsa.shared_layers:  # GLM-5.2: no indexer, the top-k of an earlier layer
        return deepseek_v3.layer_rules(mc, layer)
    return deepseek_v3.layer_rules(mc, layer) + indexer


def refuse(hf: HF) -> None:
    refuse_mla(hf)
    types = list(hf("indexer_types") or [])
    if any(t not in ("full", "shared") for t in types) or (types and types[0] != "full"):
        raise ConfigError(f"{hf.name}: HF glm_moe_dsa config has indexer_types {types[:6]}...: each 'full' or "
                          "'shared', the first 'full' (transformers' GlmMoeDsaAttention)")


def _indexer_types(a: Any) -> dict[str, Any]:
    # SGLang 0.5.14 knows the shared layers as index_topk_pattern only ("S": reuse the top-k), 0.5.23
    # reads indexer_types first (docs/model-families.md, "What SGLang 0.5.14 serves on a GPU")
    shared = a.dsa.shared_layers
    return {"indexer_types": ["shared" if i in shared else "full" for i in range(a.num_layers)],
            "index_topk_pattern": "".join("S" if i in shared else "F" for i in range(a.num_layers))}


DSA = Block("dsa", "index_topk", (
    Field("dsa.index_n_heads", "index_n_heads"),
    Field("dsa.index_head_dim", "index_head_dim"),
    Field("dsa.index_topk", "index_topk"),
    Field("dsa.shared_layers", "indexer_types 'shared'", write=_indexer_types,
          read=lambda hf: [i for i, t in enumerate(hf("indexer_types") or []) if t == "shared"]),
))


def to_hf(mc: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """GLM-5's config.json: no rope_interleave field (GLM-5 always interleaves); SGLang builds GLM-5 as
    DeepSeek-V3 (deepseek_v2.py), which reads the router fields unguarded."""
    cfg.pop("attention_bias", None)
    cfg.update(deepseek_v3_router_fields(mc.arch))
    return cfg


def layer_spec(mc, block, tcfg, *, vp_stage: int | None, packed: bool) -> None:
    from rlslurm.models.specs import sparse_attention

    sparse_attention(mc, block, tcfg, vp_stage=vp_stage, packed=packed)


FAMILY = Family(
    name="glm_moe_dsa",
    fixed=deepseek_v3.MLA_FIXED,
    fields=(MLA_KV_CHANNELS,),
    blocks=(sigmoid_router_moe("glm_moe_dsa", fixed("moe.router_score_function", "(glm_moe_dsa router)", "sigmoid"),
                               layer_types=True), MLA, DSA),
    refuse=refuse,
    to_hf=to_hf,
    layer_rules=layer_rules,
    layer_spec=layer_spec,
)
