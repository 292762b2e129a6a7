"""The model config of a run: `--model`'s YAML, or else built from `--hf-checkpoint`'s config.json.

Issue 32 item 1: slime's scripts name their model by `source scripts/models/X.sh`, and most X have
no rlslurm YAML. For every family rlslurm maps (convert/hf_config.py SUPPORTED) the architecture is
read from config.json instead, as the inverse of `expected_pairs`, and the result is put through
`check_hf_config` against the same file, so the two can never disagree silently. Such a model has no
per-node defaults unless its architecture is exactly a shipped config's (then that config is used,
defaults included): the run's flags (or the field defaults) apply. A run with neither flag is
refused naming both; there is no default model.

The trainer builds the same config from the same file on its node (trainer/setup.py), so run.yaml
records `model: null` and the checkpoint, not a copy of the architecture.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlslurm.errors import ConfigError, UserError
from rlslurm.settings.model_config import ModelConfig, load_model_config

NO_MODEL = ("no model: pass --model NAME (`rlslurm models`, or a model config YAML) or --hf-checkpoint DIR "
            "(its config.json gives the architecture)")


def run_model(model: str | None, hf_checkpoint: Path | str | None) -> ModelConfig:
    """`--model`'s config when given; else the one `--hf-checkpoint`'s config.json describes."""
    if model:
        return load_model_config(model)
    if hf_checkpoint is None:
        raise ConfigError(NO_MODEL)
    hf = Path(hf_checkpoint)
    if not (hf / "config.json").is_file():
        from rlslurm.settings.paths import model_download_hint

        if hint := model_download_hint(hf, "--hf-checkpoint"):
            raise ConfigError(f"--hf-checkpoint {hf} does not exist{hint}")
        raise ConfigError(f"--hf-checkpoint {hf}: no config.json here, so the model cannot be determined: pass "
                          "--model NAME, or run where the checkpoint is")
    return shipped_match(model_config_from_hf(hf))


def shipped_match(mc: ModelConfig) -> ModelConfig:
    """The shipped model config of exactly this architecture, with its per-node defaults (a checkpoint
    of Qwen/Qwen3-4B runs as `--model qwen3-4B` would); else `mc`, which has none."""
    from rlslurm.settings.model_config import available_models

    for name in available_models():
        shipped = load_model_config(name)
        if (shipped.arch, shipped.hf_model_type) == (mc.arch, mc.hf_model_type):
            return shipped
    return mc


def model_config_from_hf(hf_dir: Path) -> ModelConfig:
    from rlslurm.convert.hf_config import (FAMILY_FIXED, GATED_DELTA_FAMILIES, MLA_FAMILIES, NOT_EXPRESSIBLE,
                                           SUPPORTED, TEXT_CONFIG, FileConfig, _rope,
                                           check_hf_config, full_attention_interval, leading_dense,
                                           load_hf_config, qwen3_next_moe_layers)

    flag = f"--hf-checkpoint {hf_dir}"
    try:
        cfg = load_hf_config(hf_dir)
    except UserError as e:
        raise ConfigError(f"{flag}: {e}") from None
    if isinstance(cfg, FileConfig):  # derived fields and defaults are transformers' (docs/supported-stacks.md)
        raise ConfigError(f"{flag}: without --model the architecture is read from config.json with transformers, "
                          "which is not installed here: pass --model NAME (`rlslurm models`, or a model config YAML), "
                          "or install transformers where you submit")
    mt = cfg.model_type
    if mt in NOT_EXPRESSIBLE:
        raise ConfigError(f"{flag}: config.json model_type {mt!r} has no rlslurm mapping: {NOT_EXPRESSIBLE[mt]}")
    if mt not in SUPPORTED:
        raise ConfigError(f"{flag}: config.json model_type {mt!r} has no rlslurm mapping (supported: "
                          f"{', '.join(SUPPORTED)}); pass --model with a model config YAML")
    top = cfg
    if mt in TEXT_CONFIG:
        cfg = cfg.text_config  # a vision-language model: the language model's fields
    g = lambda name, default=None: getattr(cfg, name, default)  # noqa: E731
    rope = _rope(cfg)
    heads = g("num_attention_heads")
    arch: dict[str, Any] = {
        "num_layers": g("num_hidden_layers"), "hidden_size": g("hidden_size"),
        "ffn_hidden_size": g("intermediate_size"), "num_attention_heads": heads,
        "num_query_groups": g("num_key_value_heads") or heads, "vocab_size": g("vocab_size"),
        "max_position_embeddings": g("max_position_embeddings"), "norm_epsilon": g("rms_norm_eps"),
        "rotary_base": rope.get("rope_theta", 10000.0), "rotary_percent": rope.get("partial_rotary_factor", 1.0),
        "tie_word_embeddings": bool(g("tie_word_embeddings", False)),
        "activation": {"silu": "swiglu", "gelu": "gelu"}.get(g("hidden_act"), g("hidden_act")),
        "add_qkv_bias": bool(g("attention_bias", False)), "add_bias_linear": bool(g("mlp_bias", False)),
    }
    rtype = rope.get("rope_type", "default")
    if rtype not in (None, "default"):
        keys = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                "low_freq_factor", "high_freq_factor")
        arch["rope_scaling"] = {"type": rtype, **{k: rope[k] for k in keys if rope.get(k) is not None}}
    if mt in MLA_FAMILIES:
        arch["mla"] = {"q_lora_rank": g("q_lora_rank"), "kv_lora_rank": g("kv_lora_rank"),
                       "qk_head_dim": g("qk_nope_head_dim"), "qk_pos_emb_head_dim": g("qk_rope_head_dim"),
                       "v_head_dim": g("v_head_dim")}
        arch["kv_channels"] = g("v_head_dim")  # unused by MLA's attention; the shipped MLA configs say the same
    else:
        arch["kv_channels"] = g("head_dim") or g("hidden_size") // heads
    if mt == "qwen3_moe":
        arch["moe"] = {"num_experts": g("num_experts"), "router_topk": g("num_experts_per_tok"),
                       "moe_ffn_hidden_size": g("moe_intermediate_size"),
                       "router_topk_norm": bool(g("norm_topk_prob", False))}
    elif mt in ("deepseek_v3", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa"):
        arch["moe"] = {
            "num_experts": g("n_routed_experts"), "router_topk": g("num_experts_per_tok"),
            "moe_ffn_hidden_size": g("moe_intermediate_size"),
            "shared_expert_ffn_hidden_size": (g("n_shared_experts") or 0) * g("moe_intermediate_size"),
            # glm4_moe_lite: the leading dense layers of mlp_layer_types (what transformers builds);
            # check_hf_config below refuses any other pattern, or a first_k_dense_replace that differs
            "first_k_dense": (leading_dense(g("mlp_layer_types")) if mt in ("glm4_moe_lite", "glm_moe_dsa")
                              else g("first_k_dense_replace") or 0),
            "router_score_function": g("scoring_func", "sigmoid") if mt == "deepseek_v3" else "sigmoid",
            "router_topk_norm": bool(g("norm_topk_prob", False)),
            "router_scaling_factor": g("routed_scaling_factor", 1.0), "router_num_groups": g("n_group") or 1,
            "router_group_topk": g("topk_group") or 1, "router_expert_bias": True}
    elif mt == "minimax_m2":
        # every layer MoE, intermediate_size each expert's width; the router is fixed by the family
        # (check_hf_config below refuses a config.json whose switches say otherwise)
        arch["moe"] = {"num_experts": g("num_local_experts"), "router_topk": g("num_experts_per_tok"),
                       "moe_ffn_hidden_size": g("intermediate_size"), "router_score_function": "sigmoid",
                       "router_topk_norm": True, "router_expert_bias": True}
    elif mt in GATED_DELTA_FAMILIES:
        # hybrid layers and MoE as Qwen3NextConfig / Qwen3NextDecoderLayer build them; layer patterns the
        # model config cannot say are refused (hf_config.py full_attention_interval, qwen3_next_moe_layers)
        try:
            interval = full_attention_interval(hf_dir.name or str(hf_dir), list(g("layer_types") or []))
            first_dense = None if mt == "qwen3_5" else qwen3_next_moe_layers(hf_dir.name or str(hf_dir), g)
        except UserError as e:
            raise ConfigError(f"{flag}: {e}") from None
        arch["gated_delta_net"] = {
            "full_attention_interval": interval,
            "conv_kernel_dim": g("linear_conv_kernel_dim"), "key_head_dim": g("linear_key_head_dim"),
            "value_head_dim": g("linear_value_head_dim"), "num_key_heads": g("linear_num_key_heads"),
            "num_value_heads": g("linear_num_value_heads")}
        if first_dense is not None:
            arch["moe"] = {"num_experts": g("num_experts"), "router_topk": g("num_experts_per_tok"),
                           "moe_ffn_hidden_size": g("moe_intermediate_size"), "first_k_dense": first_dense,
                           "shared_expert_ffn_hidden_size": g("shared_expert_intermediate_size") or 0,
                           "shared_expert_gate": True,
                           # Qwen3.5 MoE's router always renormalises (it has no norm_topk_prob field)
                           "router_topk_norm": mt == "qwen3_5_moe" or bool(g("norm_topk_prob", False))}
        if mt == "qwen3_5_moe":
            arch["ffn_hidden_size"] = g("moe_intermediate_size")  # no dense MLP, no intermediate_size
    if mt == "glm4_moe":
        arch["qk_layernorm"] = bool(g("use_qk_norm", False))
    if mt == "glm_moe_dsa":
        # GLM-5's sparse-attention indexer; GLM-5.2's "shared" layers reuse an earlier layer's top-k
        arch["dsa"] = {"index_n_heads": g("index_n_heads"), "index_head_dim": g("index_head_dim"),
                       "index_topk": g("index_topk"),
                       "shared_layers": [i for i, t in enumerate(g("indexer_types") or []) if t == "shared"]}
    arch.update(FAMILY_FIXED[mt])
    archs = getattr(top, "architectures", None) or []
    raw = {"name": hf_dir.name or str(hf_dir), "hf_architecture": archs[0] if archs else "", "hf_model_type": mt,
           "arch": arch}
    try:
        mc = ModelConfig.model_validate(raw)
    except ValueError as e:  # pydantic's ValidationError: the first problem, one line
        first = e.errors()[0] if hasattr(e, "errors") else {"loc": (), "msg": str(e)}
        loc = ".".join(str(x) for x in first["loc"])
        raise ConfigError(f"{flag}: config.json gives a model rlslurm cannot build: {loc}: "
                          f"{first['msg'].removeprefix('Value error, ')}") from None
    try:
        check_hf_config(mc, hf_dir)  # the inverse agrees with the check the trainer makes at start-up
    except UserError as e:
        raise ConfigError(f"{flag}: {e}") from None
    return mc
