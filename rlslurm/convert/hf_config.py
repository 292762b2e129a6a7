"""Check an HF checkpoint's `config.json` against the model config.

Every field that changes the math is compared; the first mismatch is a ConfigError naming the
model-config field, the HF field and both values. HF defaults (a field absent from config.json)
come from transformers' own config class, so a checkpoint that relies on a default is judged by
the value transformers would really use.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Callable

from rlslurm.errors import ConfigError, DataError, UserError
from rlslurm.settings.model_config import ModelConfig

# Per family: what the architecture implies that config.json does not spell out.
# (field of Arch, value the HF modeling code hard-codes)
FAMILY_FIXED: dict[str, dict[str, Any]] = {
    "llama": {"qk_layernorm": False, "rotary_interleaved": False, "post_self_attn_layernorm": False,
              "post_mlp_layernorm": False, "normalization": "RMSNorm"},
    # Qwen2's attention builds q/k/v with bias=True and o_proj, MLP without; config.json has no
    # attention_bias/mlp_bias field to read.
    "qwen2": {"qk_layernorm": False, "add_qkv_bias": True, "add_bias_linear": False, "rotary_interleaved": False,
              "post_self_attn_layernorm": False, "post_mlp_layernorm": False, "normalization": "RMSNorm"},
    "qwen3": {"qk_layernorm": True, "add_qkv_bias": False, "rotary_interleaved": False,
              "post_self_attn_layernorm": False, "post_mlp_layernorm": False, "normalization": "RMSNorm"},
    "qwen3_moe": {"qk_layernorm": True, "add_qkv_bias": False, "rotary_interleaved": False,
                  "post_self_attn_layernorm": False, "post_mlp_layernorm": False, "normalization": "RMSNorm"},
    "glm4": {"qk_layernorm": False, "rotary_interleaved": True, "post_self_attn_layernorm": True,
             "post_mlp_layernorm": True, "normalization": "RMSNorm"},
    # MLA: megatron's MLA rope de-interleaves the rope dims itself, which is what HF's
    # rope_interleave=True does, so the model config says rotary_interleaved: false.
    "deepseek_v3": {"qk_layernorm": True, "add_qkv_bias": False, "rotary_interleaved": False,
                    "post_self_attn_layernorm": False, "post_mlp_layernorm": False, "normalization": "RMSNorm"},
    # GLM-4.5: rotate_half over the first partial_rotary_factor of each head (not GLM-4's
    # interleaved rotary), no sandwich norms; q/k norm and q/k/v biases are read from config.json
    # (use_qk_norm, attention_bias). docs/model-families.md.
    "glm4_moe": {"rotary_interleaved": False, "post_self_attn_layernorm": False, "post_mlp_layernorm": False,
                 "normalization": "RMSNorm"},
    # GLM-4.7-Flash: DeepSeek-V3's MLA and sigmoid-routed MoE under GLM's names for the config
    # (transformers' Glm4MoeLiteAttention is DeepseekV3Attention). docs/model-families.md.
    "glm4_moe_lite": {"qk_layernorm": True, "add_qkv_bias": False, "rotary_interleaved": False,
                      "post_self_attn_layernorm": False, "post_mlp_layernorm": False, "normalization": "RMSNorm"},
    # Xiaomi MiMo-7B: a Qwen2 model plus MTP layers (`model.mtp_layers.*`) that the mapping leaves
    # out; its config class is remote code, read here as Qwen2's (REMOTE_BASE). docs/model-families.md.
    "mimo": {"qk_layernorm": False, "add_qkv_bias": True, "add_bias_linear": False, "rotary_interleaved": False,
             "post_self_attn_layernorm": False, "post_mlp_layernorm": False, "normalization": "RMSNorm"},
    # MiniMax-M2: q_norm / k_norm are one RMSNorm each over all heads' q (k), before the head split
    # (transformers' MiniMaxM2Attention builds them num_attention_heads x head_dim and
    # num_key_value_heads x head_dim wide); no biases anywhere; rotate_half over the first
    # rotary_dim of each head, as GLM-4.5. docs/model-families.md, "MiniMax-M2".
    "minimax_m2": {"qk_layernorm": True, "qk_layernorm_all_heads": True, "add_qkv_bias": False,
                   "add_bias_linear": False, "rotary_interleaved": False, "post_self_attn_layernorm": False,
                   "post_mlp_layernorm": False, "normalization": "RMSNorm"},
    # Qwen3-Next: zero-centred norms (Qwen3NextRMSNorm: x * (1 + weight)), per-head q/k norms, gated
    # full attention (q_proj -> [q_h; gate_h] per head), rotate_half over the first
    # partial_rotary_factor of each head. docs/model-families.md, "Qwen3-Next".
    "qwen3_next": {"qk_layernorm": True, "qk_layernorm_all_heads": False, "add_qkv_bias": False,
                   "add_bias_linear": False, "rotary_interleaved": False, "post_self_attn_layernorm": False,
                   "post_mlp_layernorm": False, "normalization": "RMSNorm", "norm_zero_centered": True,
                   "attention_output_gate": True},
    # Qwen3.5 (dense, e.g. Qwen3.5-27B): Qwen3-Next's layers with a dense MLP everywhere, inside a
    # vision-language model whose text_config holds the language model's fields (TEXT_CONFIG)
    "qwen3_5": {"qk_layernorm": True, "qk_layernorm_all_heads": False, "add_qkv_bias": False,
                "add_bias_linear": False, "rotary_interleaved": False, "post_self_attn_layernorm": False,
                "post_mlp_layernorm": False, "normalization": "RMSNorm", "norm_zero_centered": True,
                "attention_output_gate": True},
    # Qwen3.5 MoE (Qwen3.5-35B-A3B): the same with Qwen3-Next's MoE block in every layer
    "qwen3_5_moe": {"qk_layernorm": True, "qk_layernorm_all_heads": False, "add_qkv_bias": False,
                    "add_bias_linear": False, "rotary_interleaved": False, "post_self_attn_layernorm": False,
                    "post_mlp_layernorm": False, "normalization": "RMSNorm", "norm_zero_centered": True,
                    "attention_output_gate": True},
    # GLM-5: GLM-4.7-Flash's MLA and MoE plus DeepSeek sparse attention's indexer in every layer
    # (transformers' GlmMoeDsaAttention/GlmMoeDsaIndexer; models/dsa.py). docs/model-families.md, "GLM-5".
    "glm_moe_dsa": {"qk_layernorm": True, "add_qkv_bias": False, "rotary_interleaved": False,
                    "post_self_attn_layernorm": False, "post_mlp_layernorm": False, "normalization": "RMSNorm"},
}

# Vision-language model_types whose language model rlslurm trains: its fields are config.json's
# `text_config`, its tensors `model.language_model.*` (convert/mapping.py); the vision tower is never
# loaded, trained or exported (docs/model-families.md, "Qwen3.5").
TEXT_CONFIG = ("qwen3_5", "qwen3_5_moe")
# families of Qwen3-Next's hybrid layers (gated delta nets and gated full attention)
GATED_DELTA_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")

SUPPORTED = tuple(FAMILY_FIXED)
MLA_FAMILIES = ("deepseek_v3", "glm4_moe_lite", "glm_moe_dsa")

# Families looked at and found inexpressible in megatron-core 0.16, -> why, for the refusal
# (docs/model-families.md, "Families megatron-core cannot express"). None at present: MiniMax-M2,
# the one listed before, is built with rlslurm's own q/k norm (models/qk_norm.py).
NOT_EXPRESSIBLE: dict[str, str] = {}

# model_type whose config class exists only as the checkpoint's remote code (auto_map), -> the
# transformers config class it subclasses, which holds every field the main model's math reads.
# MiMo's configuration_mimo.MiMoConfig is Qwen2Config plus num_nextn_predict_layers.
REMOTE_BASE = {"mimo": "qwen2"}

# model_type -> the family rlslurm builds it as, where a release names a type of its own for an
# architecture SGLang and slime serve as another: the checkpoint is read with that family's config
# class and mapped as that family, its auto_map (custom code) never run. One table until the family
# records (rlslurm/models/) hold each family's model types; docs/model-families.md, "Kimi-K2".
MODEL_TYPE_ALIASES = {
    # Kimi-K2's config.json: DeepseekV3ForCausalLM with its own model_type, so that engines pick its
    # tool parser; SGLang registers kimi_k2 as DeepseekV3Config (sglang/srt/utils/hf_transformers/
    # common.py, 0.5.14 and 0.5.23) and slime converts it as deepseek_v3 (its docs: edit the type)
    "kimi_k2": "deepseek_v3",
}


def _rope(cfg: Any) -> dict[str, Any]:
    """transformers 5 keeps rope settings in `rope_parameters`; 4.x in rope_theta/rope_scaling."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    if "rope_theta" not in params and getattr(cfg, "rope_theta", None) is not None:
        params["rope_theta"] = cfg.rope_theta
    scaling = getattr(cfg, "rope_scaling", None)
    if isinstance(scaling, dict):
        for k, v in scaling.items():
            params.setdefault(k, v)
    if "partial_rotary_factor" not in params and getattr(cfg, "partial_rotary_factor", None) is not None:
        params["partial_rotary_factor"] = cfg.partial_rotary_factor
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params["type"]
    return params


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
        except (TypeError, ValueError):
            return False
    return a == b


class FileConfig:
    """config.json as written, for a host without transformers (a login node that submits a job running
    another environment: docs/supported-stacks.md). Its keys are attributes (`text_config` a FileConfig
    too); a field the file leaves out is missing here, where transformers would fill in its default, so
    `check_hf_config` leaves the comparisons that need one to the trainer, which runs with transformers."""

    def __init__(self, raw: dict[str, Any]):
        for k, v in raw.items():
            setattr(self, k, FileConfig(v) if k == "text_config" and isinstance(v, dict) else v)


def _left_out(cfg: FileConfig, hf_field: str) -> bool:
    """Whether a compared HF field (`num_key_value_heads`, `rope_parameters.rope_theta`,
    `n_shared_experts*moe_intermediate_size`) is missing from the file, so that its value would be
    transformers' default; a family's fixed value (`(qwen3_moe router)`) is never."""
    if hf_field.startswith("("):
        return False
    where = [cfg, getattr(cfg, "text_config", None)]
    where += [getattr(c, d, None) for c in where if c is not None for d in ("rope_parameters", "rope_scaling")]
    names = [n for n in re.findall(r"[A-Za-z_]\w*", hf_field) if n != "rope_parameters"]
    return not all(any(n in (vars(c) if isinstance(c, FileConfig) else c) for c in where if isinstance(c, (dict, FileConfig)))
                   for n in names)


def load_hf_config(hf_dir: str | Path):
    """The transformers config object of a checkpoint directory (offline; defaults filled in); where
    transformers is not installed, the file as written (FileConfig)."""
    try:
        from transformers import AutoConfig
    except ModuleNotFoundError:
        AutoConfig = None

    path = Path(hf_dir) / "config.json"
    if not path.exists():
        raise ConfigError(f"{hf_dir}: no config.json (not an HF checkpoint directory)")
    try:
        raw = json.loads(path.read_bytes())
    except json.JSONDecodeError as e:
        raise DataError(str(path), f"invalid JSON: {e}") from None
    except UnicodeDecodeError as e:
        raise DataError(str(path), f"not UTF-8 text ({e.reason} at byte {e.start}), so not a config.json") from None
    except OSError as e:
        raise DataError(str(path), f"cannot read it: {e.strerror or e}") from None
    if not isinstance(raw, dict):
        raise DataError(str(path), f"a JSON {type(raw).__name__}, not an object")
    if "model_type" not in raw:
        raise DataError(str(path), "no model_type")
    family = MODEL_TYPE_ALIASES.get(raw["model_type"])
    if family is not None:
        raw = {**raw, "model_type": family}
    if AutoConfig is None:
        return FileConfig(raw)
    try:
        if family is not None or raw["model_type"] in REMOTE_BASE:
            # without the remote code transformers does not know the type: read the fields with the
            # class the remote one subclasses (an alias: its family's), keeping the family's model_type
            fields = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map")}
            cfg = AutoConfig.for_model(family or REMOTE_BASE[raw["model_type"]], **fields)
            cfg.model_type = raw["model_type"]
            return cfg
        # trust_remote_code=False: a type transformers does not know is one line, never a prompt
        # on stdin asking to run the checkpoint's code
        return AutoConfig.from_pretrained(str(hf_dir), local_files_only=True, trust_remote_code=False)
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(str(path), f"transformers cannot read it: {e}") from None


def identity_pairs(mc: ModelConfig, cfg: Any) -> list[tuple[str, Any, str, Any]]:
    """Which model the checkpoint is: model_type, and architectures where the file names any."""
    pairs: list[tuple[str, Any, str, Any]] = [("hf_model_type", mc.hf_model_type, "model_type", cfg.model_type)]
    archs = getattr(cfg, "architectures", None)
    if mc.hf_architecture not in (archs or [mc.hf_architecture]):
        pairs.append(("hf_architecture", mc.hf_architecture, "architectures", archs))
    return pairs


def expected_pairs(mc: ModelConfig, cfg: Any, *, family: bool = True) -> list[tuple[str, Any, str, Any]]:
    """(model-config field, its value, HF field, HF value) for every math-changing field; `family=False`:
    only those every family has (sizes, norms, rope), without the family's own rules."""
    a = mc.arch
    mt = cfg.model_type
    top = cfg
    if mt in TEXT_CONFIG:
        cfg = cfg.text_config  # the language model's fields; model_type and architectures stay the file's
    rope = _rope(cfg)
    g: Callable[[str, Any], Any] = lambda name, default=None: getattr(cfg, name, default)  # noqa: E731
    heads = g("num_attention_heads")
    pairs: list[tuple[str, Any, str, Any]] = identity_pairs(mc, top) + [
        ("arch.num_layers", a.num_layers, "num_hidden_layers", g("num_hidden_layers")),
        ("arch.hidden_size", a.hidden_size, "hidden_size", g("hidden_size")),
        # Qwen3.5 MoE has no dense MLP (no intermediate_size): the model config keeps the experts' width
        ("arch.ffn_hidden_size", a.ffn_hidden_size, *(("moe_intermediate_size", g("moe_intermediate_size"))
                                                      if mt == "qwen3_5_moe" else
                                                      ("intermediate_size", g("intermediate_size")))),
        ("arch.num_attention_heads", a.num_attention_heads, "num_attention_heads", heads),
        ("arch.num_query_groups", a.num_query_groups, "num_key_value_heads", g("num_key_value_heads", heads)),
        ("arch.vocab_size", a.vocab_size, "vocab_size", g("vocab_size")),
        ("arch.norm_epsilon", a.norm_epsilon, "rms_norm_eps", g("rms_norm_eps")),
        ("arch.rotary_base", a.rotary_base, "rope_parameters.rope_theta", rope.get("rope_theta")),
        ("arch.rotary_percent", a.rotary_percent, "partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)),
        ("arch.tie_word_embeddings", a.tie_word_embeddings, "tie_word_embeddings", g("tie_word_embeddings")),
        ("arch.activation", a.activation, "hidden_act",
         {"silu": "swiglu", "gelu": "gelu"}.get(g("hidden_act"), g("hidden_act"))),
    ]
    if not a.mla:
        head_dim = g("head_dim") or g("hidden_size") // heads
        pairs.append(("arch.kv_channels", a.kv_channels, "head_dim", head_dim))
    if mt in ("llama", "glm4", "qwen3", "qwen3_moe", "glm4_moe"):
        pairs.append(("arch.add_qkv_bias", a.add_qkv_bias, "attention_bias", bool(g("attention_bias", False))))
        pairs.append(("arch.add_bias_linear", a.add_bias_linear, "mlp_bias", bool(g("mlp_bias", False))))
    rtype = rope.get("rope_type", "default")
    if rtype in (None, "default"):
        pairs.append(("arch.rope_scaling", a.rope_scaling, "rope_parameters.rope_type", None))
    else:
        rs = a.rope_scaling
        pairs.append(("arch.rope_scaling.type", rs.type if rs else None, "rope_parameters.rope_type", rtype))
        if rs is not None:
            pairs.append(("arch.rope_scaling.factor", rs.factor, "rope_parameters.factor", rope.get("factor")))
            pairs.append(("arch.rope_scaling.original_max_position_embeddings", rs.original_max_position_embeddings,
                          "rope_parameters.original_max_position_embeddings",
                          rope.get("original_max_position_embeddings")))
            for f in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "low_freq_factor", "high_freq_factor"):
                if rope.get(f) is not None:
                    pairs.append((f"arch.rope_scaling.{f}", getattr(rs, f), f"rope_parameters.{f}", rope.get(f)))
    if not family:
        return pairs
    if "sliding_attention" in (g("layer_types") or []):
        # Qwen2/Qwen3 configs can switch on sliding-window layers (use_sliding_window); the
        # Megatron model attends over the whole sequence. Released Qwen2.5/Qwen3 checkpoints keep it off.
        raise ConfigError(f"{mc.name}: HF config has sliding-window attention layers (use_sliding_window), "
                          "which the Megatron model does not implement")
    if mt == "qwen3_moe":
        m = a.moe
        if g("mlp_only_layers") or g("decoder_sparse_step", 1) != 1:
            raise ConfigError(f"{mc.name}: HF config uses mlp_only_layers/decoder_sparse_step != 1, "
                              "which the qwen3_moe mapping does not support")
        pairs += [
            ("arch.moe", "set" if m else None, "num_experts", "set"),
        ]
        if m:
            pairs += [
                ("arch.moe.num_experts", m.num_experts, "num_experts", g("num_experts")),
                ("arch.moe.router_topk", m.router_topk, "num_experts_per_tok", g("num_experts_per_tok")),
                ("arch.moe.moe_ffn_hidden_size", m.moe_ffn_hidden_size, "moe_intermediate_size",
                 g("moe_intermediate_size")),
                ("arch.moe.router_topk_norm", m.router_topk_norm, "norm_topk_prob", g("norm_topk_prob")),
                ("arch.moe.router_score_function", m.router_score_function, "(qwen3_moe router)", "softmax"),
                ("arch.moe.shared_expert_ffn_hidden_size", m.shared_expert_ffn_hidden_size, "(qwen3_moe)", 0),
                ("arch.moe.first_k_dense", m.first_k_dense, "mlp_only_layers", 0),
            ]
    elif mt in MLA_FAMILIES:
        m, l = a.moe, a.mla
        pairs += [("arch.moe", "set" if m else None, "n_routed_experts", "set"),
                  ("arch.mla", "set" if l else None, "kv_lora_rank", "set")]
        if g("attention_bias", False):
            # HF then adds biases to q_a_proj, kv_a_proj_with_mqa and o_proj; megatron-core's MLA
            # builds those linears without (multi_latent_attention.py)
            raise ConfigError(f"{mc.name}: HF {mt} config has attention_bias=true, which megatron-core's "
                              "multi-latent attention does not build")
        if m and mt == "deepseek_v3":
            pairs += _sigmoid_router_moe(mc, g, scoring=("scoring_func", g("scoring_func", "sigmoid")))
        elif m:
            pairs += _sigmoid_router_moe(mc, g, scoring=(f"({mt} router)", "sigmoid"),
                                         first_dense=("mlp_layer_types", _lite_first_dense(mc, g)))
        if mt == "glm_moe_dsa":
            pairs += _glm_moe_dsa(mc, g)
        if l:
            pairs += [
                ("arch.mla.q_lora_rank", l.q_lora_rank, "q_lora_rank", g("q_lora_rank")),
                ("arch.mla.kv_lora_rank", l.kv_lora_rank, "kv_lora_rank", g("kv_lora_rank")),
                ("arch.mla.qk_head_dim", l.qk_head_dim, "qk_nope_head_dim", g("qk_nope_head_dim")),
                ("arch.mla.qk_pos_emb_head_dim", l.qk_pos_emb_head_dim, "qk_rope_head_dim", g("qk_rope_head_dim")),
                ("arch.mla.v_head_dim", l.v_head_dim, "v_head_dim", g("v_head_dim")),
            ]
        if not g("rope_interleave", True):
            raise ConfigError(f"{mc.name}: HF {mt} config has rope_interleave=false, which the mapping "
                              "does not support")
    elif mt == "glm4_moe":
        # Released GLM-4.5 checkpoints carry num_nextn_predict_layers MTP layers after the last
        # decoder layer; the mapping ignores them, so that field is not compared.
        pairs += [("arch.qk_layernorm", a.qk_layernorm, "use_qk_norm", bool(g("use_qk_norm", False))),
                  ("arch.moe", "set" if a.moe else None, "n_routed_experts", "set")]
        if a.moe:
            pairs += _sigmoid_router_moe(mc, g, scoring=("(glm4_moe router)", "sigmoid"))
    elif mt == "minimax_m2":
        pairs += _minimax_m2(mc, g)
    elif mt in GATED_DELTA_FAMILIES:
        pairs += _qwen3_next(mc, g)
    elif a.moe is not None:
        pairs.append(("arch.moe", "set", f"({mt} is dense)", None))
    if mt not in GATED_DELTA_FAMILIES and a.gated_delta_net is not None:
        pairs.append(("arch.gated_delta_net", "set", f"({mt} has no linear attention)", None))
    if mt not in MLA_FAMILIES and a.mla is not None:
        pairs.append(("arch.mla", "set", f"({mt} has no MLA)", None))
    if mt != "glm_moe_dsa" and a.dsa is not None:
        pairs.append(("arch.dsa", "set", f"({mt} has no sparse attention indexer)", None))
    for field, value in FAMILY_FIXED.get(mt, {}).items():
        pairs.append((f"arch.{field}", getattr(a, field), f"({mt} architecture)", value))
    return pairs


def _minimax_m2(mc: ModelConfig, g: Callable[..., Any]) -> list[tuple]:
    """MiniMax-M2's MoE fields, and the config.json switches of the release that transformers 5.19's
    MiniMaxM2 ignores (it always builds the whole-width q/k norm, the sigmoid router with its
    correction bias, no shared expert, full attention in every layer): a config that turns one of
    them to something else describes a model that transformers would not compute as written, so it
    is refused rather than guessed at (docs/model-families.md, "MiniMax-M2")."""
    ignored = {"use_qk_norm": (True, "q_norm/k_norm"), "qk_norm_type": ("per_layer", "one q/k norm over all heads"),
               "scoring_func": ("sigmoid", "sigmoid router scores"),
               "use_routing_bias": (True, "the router's e_score_correction_bias"),
               "shared_intermediate_size": (0, "no shared expert")}
    for field, (value, what) in ignored.items():
        have = g(field, value)
        if have != value:
            raise ConfigError(f"{mc.name}: HF minimax_m2 config has {field}={have!r}, but transformers' MiniMaxM2 "
                              f"always builds {what} ({field}={value!r}), and so does the mapping")
    kinds = set(g("attn_type_list") or [1])
    if kinds != {1}:
        raise ConfigError(f"{mc.name}: HF minimax_m2 config has attn_type_list entries {sorted(kinds - {1})} (not full "
                          "attention), which transformers' MiniMaxM2 and the mapping do not build")
    m = mc.arch.moe
    pairs: list[tuple] = [("arch.moe", "set" if m else None, "num_local_experts", "set")]
    if m:
        pairs += [
            ("arch.moe.num_experts", m.num_experts, "num_local_experts", g("num_local_experts")),
            ("arch.moe.router_topk", m.router_topk, "num_experts_per_tok", g("num_experts_per_tok")),
            # every layer is MoE; intermediate_size is each expert's width
            ("arch.moe.moe_ffn_hidden_size", m.moe_ffn_hidden_size, "intermediate_size", g("intermediate_size")),
            ("arch.moe.shared_expert_ffn_hidden_size", m.shared_expert_ffn_hidden_size, "shared_intermediate_size",
             g("shared_intermediate_size", 0)),
            ("arch.moe.first_k_dense", m.first_k_dense, "(minimax_m2: every layer MoE)", 0),
            ("arch.moe.router_score_function", m.router_score_function, "scoring_func", g("scoring_func", "sigmoid")),
            # MiniMaxM2TopKRouter divides the chosen scores by their sum, unscaled, ungrouped
            ("arch.moe.router_topk_norm", m.router_topk_norm, "(minimax_m2 router)", True),
            ("arch.moe.router_scaling_factor", m.router_scaling_factor, "(minimax_m2 router)", 1.0),
            ("arch.moe.router_num_groups", m.router_num_groups, "(minimax_m2 router)", 1),
            ("arch.moe.router_group_topk", m.router_group_topk, "(minimax_m2 router)", 1),
            ("arch.moe.router_expert_bias", m.router_expert_bias, "use_routing_bias", g("use_routing_bias", True)),
        ]
    return pairs


def full_attention_interval(mc_name: str, types: list[str]) -> int:
    """The N of an HF Qwen3-Next `layer_types` list in which exactly every N-th layer is
    "full_attention" and the others "linear_attention" (what HF's full_attention_interval builds and
    megatron's int linear_attention_freq expresses); N > layers when none is. Any other list is refused."""
    n = len(types)
    interval = next((i + 1 for i, t in enumerate(types) if t == "full_attention"), n + 1)
    want = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    if types != want:
        raise ConfigError(f"{mc_name}: HF layer_types {types} is not every N-th layer full attention and "
                          "the others linear_attention, which is all the model config (full_attention_interval) and "
                          "megatron-core's linear_attention_freq express here")
    return interval


def qwen3_next_moe_layers(mc_name: str, g: Callable[..., Any]) -> int | None:
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


def _qwen3_next(mc: ModelConfig, g: Callable[..., Any]) -> list[tuple]:
    """Qwen3-Next (and Qwen3.5's language model): the gated delta net and MoE fields
    (docs/model-families.md, "Qwen3-Next", "Qwen3.5")."""
    d, m = mc.arch.gated_delta_net, mc.arch.moe
    mt = mc.hf_model_type
    if g("attention_bias", False):
        raise ConfigError(f"{mc.name}: HF {mt} config has attention_bias=true, which gives o_proj a bias too; "
                          "megatron-core's add_qkv_bias covers q/k/v only (add_bias_linear would add MLP biases)")
    if g("attn_output_gate", True) is not True:
        # Qwen3.5's config.json says attn_output_gate; transformers builds the gate whatever it says
        raise ConfigError(f"{mc.name}: HF {mt} config has attn_output_gate={g('attn_output_gate')!r}, but "
                          "transformers' Qwen3NextAttention always builds the output gate, and so does the mapping")
    types = list(g("layer_types") or [])
    pairs: list[tuple] = [("arch.gated_delta_net", "set" if d else None, "layer_types", "set")]
    if d:
        pairs += [
            ("arch.gated_delta_net.full_attention_interval", d.full_attention_interval, "layer_types",
             full_attention_interval(mc.name, types)),
            ("arch.gated_delta_net.conv_kernel_dim", d.conv_kernel_dim, "linear_conv_kernel_dim",
             g("linear_conv_kernel_dim")),
            ("arch.gated_delta_net.key_head_dim", d.key_head_dim, "linear_key_head_dim", g("linear_key_head_dim")),
            ("arch.gated_delta_net.value_head_dim", d.value_head_dim, "linear_value_head_dim",
             g("linear_value_head_dim")),
            ("arch.gated_delta_net.num_key_heads", d.num_key_heads, "linear_num_key_heads", g("linear_num_key_heads")),
            ("arch.gated_delta_net.num_value_heads", d.num_value_heads, "linear_num_value_heads",
             g("linear_num_value_heads")),
        ]
    if mt == "qwen3_5":  # Qwen3_5DecoderLayer: a dense Qwen3_5MLP in every layer
        return pairs + [("arch.moe", "set" if m else None, "(qwen3_5 is dense)", None)]
    first_dense = qwen3_next_moe_layers(mc.name, g)
    pairs.append(("arch.moe", "set" if m else None, "num_experts", "set" if first_dense is not None else None))
    if m and first_dense is not None:
        pairs += [
            ("arch.moe.num_experts", m.num_experts, "num_experts", g("num_experts")),
            ("arch.moe.router_topk", m.router_topk, "num_experts_per_tok", g("num_experts_per_tok")),
            ("arch.moe.moe_ffn_hidden_size", m.moe_ffn_hidden_size, "moe_intermediate_size", g("moe_intermediate_size")),
            ("arch.moe.first_k_dense", m.first_k_dense, "mlp_only_layers/decoder_sparse_step", first_dense),
            ("arch.moe.shared_expert_ffn_hidden_size", m.shared_expert_ffn_hidden_size,
             "shared_expert_intermediate_size", g("shared_expert_intermediate_size")),
            # Qwen3NextSparseMoeBlock always builds shared_expert_gate; Qwen3NextTopKRouter: softmax,
            # top-k, divided by their sum when norm_topk_prob, no scaling, no groups, no bias
            ("arch.moe.shared_expert_gate", m.shared_expert_gate, "(qwen3_next shared_expert_gate)", True),
            # Qwen3.5 MoE's router (Qwen3VLMoeTextTopKRouter) always divides by the sum; no such field
            ("arch.moe.router_topk_norm", m.router_topk_norm,
             *(("(qwen3_5_moe router)", True) if mt == "qwen3_5_moe" else ("norm_topk_prob", g("norm_topk_prob")))),
            ("arch.moe.router_score_function", m.router_score_function, "(qwen3_next router)", "softmax"),
            ("arch.moe.router_scaling_factor", m.router_scaling_factor, "(qwen3_next router)", 1.0),
            ("arch.moe.router_num_groups", m.router_num_groups, "(qwen3_next router)", 1),
            ("arch.moe.router_expert_bias", m.router_expert_bias, "(qwen3_next router)", False),
        ]
    return pairs


def _glm_moe_dsa(mc: ModelConfig, g: Callable[..., Any]) -> list[tuple]:
    """GLM-5's sparse-attention indexer fields (transformers 5.19 GlmMoeDsaConfig / GlmMoeDsaIndexer),
    GLM-5.2's shared layers among them (docs/model-families.md, "GLM-5")."""
    d = mc.arch.dsa
    types = list(g("indexer_types") or [])
    if any(t not in ("full", "shared") for t in types) or (types and types[0] != "full"):
        raise ConfigError(f"{mc.name}: HF glm_moe_dsa config has indexer_types {types[:6]}...: each 'full' or "
                          "'shared', the first 'full' (transformers' GlmMoeDsaAttention)")
    pairs: list[tuple] = [("arch.dsa", "set" if d else None, "index_topk", "set")]
    if d:
        pairs += [("arch.dsa.index_n_heads", d.index_n_heads, "index_n_heads", g("index_n_heads")),
                  ("arch.dsa.index_head_dim", d.index_head_dim, "index_head_dim", g("index_head_dim")),
                  ("arch.dsa.index_topk", d.index_topk, "index_topk", g("index_topk")),
                  # GLM-5.2: a "shared" layer reuses the top-k of the last "full" layer before it
                  ("arch.dsa.shared_layers", list(d.shared_layers), "indexer_types 'shared'",
                   [i for i, t in enumerate(types) if t == "shared"])]
    return pairs


def leading_dense(types: list[str] | None) -> int:
    """How many entries of an HF mlp_layer_types list are "dense" before the first other one."""
    types = list(types or [])
    return next((i for i, t in enumerate(types) if t != "dense"), len(types))


def _lite_first_dense(mc: ModelConfig, g: Callable[..., Any]) -> int:
    """glm4_moe_lite's leading dense layers. transformers builds each layer from `mlp_layer_types`
    (default: one dense, then sparse) and ignores first_k_dense_replace; SGLang's glm4_moe_lite.py
    reads first_k_dense_replace. Both must say the same, and the dense layers must lead."""
    types = list(g("mlp_layer_types") or [])
    k = leading_dense(types)
    if any(t != "sparse" for t in types[k:]):
        raise ConfigError(f"{mc.name}: HF {mc.hf_model_type} mlp_layer_types {types} is not dense layers followed by "
                          "sparse ones, which is all megatron-core's moe_layer_freq here expresses")
    fk = g("first_k_dense_replace")
    if fk is not None and fk != k:
        raise ConfigError(f"{mc.name}: HF {mc.hf_model_type} config has first_k_dense_replace={fk} (SGLang's) but "
                          f"mlp_layer_types starts with {k} dense layer(s) (transformers')")
    return k


def _sigmoid_router_moe(mc: ModelConfig, g: Callable[..., Any], *, scoring: tuple[str, Any],
                        first_dense: tuple[str, Any] | None = None) -> list[tuple]:
    """DeepSeek-V3-style MoE fields (deepseek_v3, glm4_moe, glm4_moe_lite): routed experts behind a
    sigmoid router with a score-correction bias and group-limited top-k, n_shared_experts shared
    experts of moe_intermediate_size each, first_k_dense_replace (or `first_dense`) dense layers."""
    m = mc.arch.moe
    first_dense = first_dense or ("first_k_dense_replace", g("first_k_dense_replace"))
    return [
        ("arch.moe.num_experts", m.num_experts, "n_routed_experts", g("n_routed_experts")),
        ("arch.moe.router_topk", m.router_topk, "num_experts_per_tok", g("num_experts_per_tok")),
        ("arch.moe.moe_ffn_hidden_size", m.moe_ffn_hidden_size, "moe_intermediate_size", g("moe_intermediate_size")),
        ("arch.moe.shared_expert_ffn_hidden_size", m.shared_expert_ffn_hidden_size,
         "n_shared_experts*moe_intermediate_size", (g("n_shared_experts") or 0) * g("moe_intermediate_size")),
        ("arch.moe.first_k_dense", m.first_k_dense, *first_dense),
        ("arch.moe.router_score_function", m.router_score_function, *scoring),
        ("arch.moe.router_topk_norm", m.router_topk_norm, "norm_topk_prob", g("norm_topk_prob")),
        ("arch.moe.router_scaling_factor", m.router_scaling_factor, "routed_scaling_factor",
         g("routed_scaling_factor")),
        ("arch.moe.router_num_groups", m.router_num_groups, "n_group", g("n_group")),
        ("arch.moe.router_group_topk", m.router_group_topk, "topk_group", g("topk_group")),
        ("arch.moe.router_expert_bias", m.router_expert_bias, f"({mc.hf_model_type} e_score_correction_bias)", True),
    ]


def check_hf_config(mc: ModelConfig, hf_dir: str | Path) -> list[str]:
    """Raise ConfigError naming the first field where `mc` and `hf_dir/config.json` disagree. Returns what
    was not compared: nothing with transformers; without it (FileConfig) the fields config.json leaves out,
    whose values would be transformers' defaults, or the family's fields when its rules need a field
    transformers derives. model_type and architectures are always compared."""
    cfg = load_hf_config(hf_dir)
    if cfg.model_type not in SUPPORTED:
        if cfg.model_type in NOT_EXPRESSIBLE:
            raise ConfigError(f"{hf_dir}/config.json: model_type={cfg.model_type!r} has no mapping: "
                              f"{NOT_EXPRESSIBLE[cfg.model_type]}")
        raise ConfigError(f"{hf_dir}/config.json: model_type={cfg.model_type!r} has no mapping; "
                          f"supported: {', '.join(SUPPORTED)}")
    file_only = isinstance(cfg, FileConfig)
    unchecked: list[str] = []
    try:
        pairs = expected_pairs(mc, cfg)
    except (UserError, TypeError):
        if not file_only:
            raise
        # the family's own rules read fields transformers derives (layer_types from full_attention_interval,
        # mlp_layer_types from first_k_dense_replace, ...): without it they cannot be told here
        unchecked.append(f"the {cfg.model_type} family's own fields (its rules read what transformers derives)")
        try:
            pairs = expected_pairs(mc, cfg, family=False)
        except TypeError:  # a size the others are computed from is left out
            pairs = identity_pairs(mc, cfg)
    for field, ours, hf_field, theirs in pairs:
        if file_only and _left_out(cfg, hf_field):
            unchecked.append(hf_field)  # transformers' default, which the trainer compares
        elif not _same(ours, theirs):
            raise ConfigError(
                f"model config {mc.name!r} does not match {hf_dir}/config.json: "
                f"{field}={ours!r} but HF {hf_field}={theirs!r}"
            )
    return unchecked
