"""config.json vs model config: every math-changing field is compared, mismatches name the field
and both values."""

from __future__ import annotations

import json
import shutil

import pytest
from convert_helpers import FAMILIES

from rlslurm.convert import check_hf_config
from rlslurm.errors import ConfigError
from rlslurm.settings.model_config import load_model_config


def _with_arch(name: str, **changes):
    mc = load_model_config(name)
    return mc.model_copy(update={"arch": mc.arch.model_copy(update=changes)})


@pytest.mark.parametrize("name", FAMILIES)
def test_matching_config_passes(tiny_ckpts, name):
    check_hf_config(load_model_config(name), tiny_ckpts / name)


@pytest.mark.parametrize("name,changes,field,ours,theirs", [
    ("tiny-qwen3", {"num_query_groups": 1}, "arch.num_query_groups", "1", "num_key_value_heads=2"),
    ("tiny-qwen3", {"qk_layernorm": False}, "arch.qk_layernorm", "False", "True"),
    ("tiny-llama", {"rotary_base": 10000.0}, "arch.rotary_base", "10000.0", "rope_theta=500000"),
    ("tiny-glm4", {"post_mlp_layernorm": False}, "arch.post_mlp_layernorm", "False", "True"),
    ("tiny-glm4", {"rotary_percent": 1.0}, "arch.rotary_percent", "1.0", "partial_rotary_factor=0.5"),
    ("tiny-glm4", {"add_qkv_bias": False}, "arch.add_qkv_bias", "False", "attention_bias=True"),
    ("tiny-llama", {"tie_word_embeddings": True}, "arch.tie_word_embeddings", "True", "False"),
    # Qwen2: biases and no q/k norm are the architecture's (no config.json field), ties are read
    ("tiny-qwen2", {"add_qkv_bias": False}, "arch.add_qkv_bias", "False", "True"),
    ("tiny-qwen2", {"qk_layernorm": True}, "arch.qk_layernorm", "True", "False"),
    ("tiny-qwen2", {"add_bias_linear": True}, "arch.add_bias_linear", "True", "False"),
    ("tiny-qwen2", {"tie_word_embeddings": False}, "arch.tie_word_embeddings", "False", "True"),
    ("tiny-llama", {"norm_epsilon": 1e-6}, "arch.norm_epsilon", "1e-06", "1e-05"),
])
def test_dense_mismatch_names_field_and_values(tiny_ckpts, name, changes, field, ours, theirs):
    with pytest.raises(ConfigError) as e:
        check_hf_config(_with_arch(name, **changes), tiny_ckpts / name)
    msg = str(e.value)
    assert f"{field}=" in msg and ours in msg and theirs in msg, msg


def test_moe_mismatches_are_named(tiny_ckpts):
    mc = load_model_config("tiny-qwen3-moe")
    bad = mc.model_copy(update={"arch": mc.arch.model_copy(
        update={"moe": mc.arch.moe.model_copy(update={"router_topk": 1})})})
    with pytest.raises(ConfigError, match=r"arch\.moe\.router_topk=1 .*num_experts_per_tok=2"):
        check_hf_config(bad, tiny_ckpts / "tiny-qwen3-moe")
    with pytest.raises(ConfigError, match=r"arch\.moe=None .*num_experts='set'"):
        check_hf_config(_with_arch("tiny-qwen3-moe", moe=None), tiny_ckpts / "tiny-qwen3-moe")


def test_mla_mismatch_is_named(tiny_ckpts):
    mc = load_model_config("tiny-deepseek-v3")
    bad = mc.model_copy(update={"arch": mc.arch.model_copy(
        update={"mla": mc.arch.mla.model_copy(update={"kv_lora_rank": 16})})})
    with pytest.raises(ConfigError, match=r"arch\.mla\.kv_lora_rank=16 .*kv_lora_rank=24"):
        check_hf_config(bad, tiny_ckpts / "tiny-deepseek-v3")


def test_other_family_checkpoint_is_refused(tiny_ckpts):
    with pytest.raises(ConfigError, match=r"hf_model_type='qwen3' .*model_type='llama'"):
        check_hf_config(load_model_config("tiny-qwen3"), tiny_ckpts / "tiny-llama")


# Qwen2.5-7B-Instruct's config.json as released (transformers 4.43 spelling: rope_theta at the top
# level, sliding_window set but use_sliding_window false, no head_dim, no layer_types).
QWEN25_7B_INSTRUCT = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
    "intermediate_size": 18944, "max_position_embeddings": 32768, "max_window_layers": 28,
    "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.43.1", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 152064,
}


def test_shipped_qwen25_7b_matches_the_released_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_7B_INSTRUCT))
    check_hf_config(load_model_config("qwen2.5-7B"), tmp_path)
    # the 3B and smaller tie their embeddings: the same file with ties on is refused
    (tmp_path / "config.json").write_text(json.dumps({**QWEN25_7B_INSTRUCT, "tie_word_embeddings": True}))
    with pytest.raises(ConfigError, match=r"arch\.tie_word_embeddings=False"):
        check_hf_config(load_model_config("qwen2.5-7B"), tmp_path)


def test_sliding_window_checkpoint_is_refused(tiny_ckpts, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_ckpts / "tiny-qwen2", d)
    cfg = json.loads((d / "config.json").read_text())
    # as a released Qwen2.5 config.json spells it (no layer_types: transformers derives them)
    cfg.pop("layer_types", None)
    cfg.update(use_sliding_window=True, sliding_window=32, max_window_layers=1)  # layer 1 slides
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="sliding-window"):
        check_hf_config(load_model_config("tiny-qwen2"), d)


# GLM-4.5-Air's config.json as released (transformers 4.54 spelling: rope_theta and
# partial_rotary_factor at the top level); the file itself was not reachable from here,
# docs/model-families.md says where each value was checked.
GLM45_AIR = {
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "partial_rotary_factor": 0.5, "initializer_range": 0.02, "intermediate_size": 10944,
    "max_position_embeddings": 131072, "model_type": "glm4_moe", "moe_intermediate_size": 1408,
    "norm_topk_prob": True, "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 128,
    "n_shared_experts": 1, "routed_scaling_factor": 1.0, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
    "num_hidden_layers": 46, "num_key_value_heads": 8, "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 1000000, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.54.0", "use_cache": True, "use_qk_norm": False, "vocab_size": 151552,
}

# Moonlight-16B-A3B's config.json as published (as another project's test pins it; the model card's
# file was not reachable from here). Its auto_map points at remote code that transformers' own
# deepseek_v3 replaces.
MOONLIGHT = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModel": "modeling_deepseek.DeepseekV3Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    "aux_loss_alpha": 0.001, "bos_token_id": 163584, "eos_token_id": 163586, "ep_size": 1,
    "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 11264, "kv_lora_rank": 512, "max_position_embeddings": 8192, "model_type": "deepseek_v3",
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2,
    "norm_topk_prob": True, "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
    "num_key_value_heads": 16, "num_nextn_predict_layers": 0, "pretraining_tp": 1, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05, "rope_theta": 50000.0,
    "routed_scaling_factor": 2.446, "scoring_func": "sigmoid", "seq_aux": True, "tie_word_embeddings": False,
    "topk_group": 1, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "transformers_version": "4.46.3",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 163840,
}


def _write(d, cfg):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_shipped_glm45_air_matches_the_released_config(tmp_path):
    check_hf_config(load_model_config("glm4.5-air"), _write(tmp_path / "air", GLM45_AIR))
    # GLM-4.5 (355B) turns q/k norm on; a checkpoint relying on transformers' default rotary factor
    # (0.5) matches too
    with pytest.raises(ConfigError, match=r"arch\.qk_layernorm=False .*use_qk_norm=True"):
        check_hf_config(load_model_config("glm4.5-air"), _write(tmp_path / "qk", {**GLM45_AIR, "use_qk_norm": True}))
    no_factor = {k: v for k, v in GLM45_AIR.items() if k != "partial_rotary_factor"}
    check_hf_config(load_model_config("glm4.5-air"), _write(tmp_path / "default", no_factor))
    with pytest.raises(ConfigError, match=r"arch\.moe\.shared_expert_ffn_hidden_size=1408 .*=2816"):
        check_hf_config(load_model_config("glm4.5-air"), _write(tmp_path / "sh", {**GLM45_AIR, "n_shared_experts": 2}))


def test_shipped_moonlight_matches_the_released_config(tmp_path):
    check_hf_config(load_model_config("moonlight-16B-A3B"), _write(tmp_path / "m", MOONLIGHT))
    with pytest.raises(ConfigError, match=r"arch\.mla\.q_lora_rank=None .*q_lora_rank=1536"):
        check_hf_config(load_model_config("moonlight-16B-A3B"),
                        _write(tmp_path / "q", {**MOONLIGHT, "q_lora_rank": 1536}))


@pytest.mark.parametrize("changes,field,ours,theirs", [
    ({"qk_layernorm": False}, "arch.qk_layernorm", "False", "use_qk_norm=True"),
    ({"add_qkv_bias": False}, "arch.add_qkv_bias", "False", "attention_bias=True"),
    ({"rotary_percent": 1.0}, "arch.rotary_percent", "1.0", "partial_rotary_factor=0.5"),
    ({"rotary_interleaved": True}, "arch.rotary_interleaved", "True", "False"),
    ({"kv_channels": 16}, "arch.kv_channels", "16", "head_dim=32"),
])
def test_glm4_moe_mismatch_names_field_and_values(tiny_ckpts, changes, field, ours, theirs):
    with pytest.raises(ConfigError) as e:
        check_hf_config(_with_arch("tiny-glm4-moe", **changes), tiny_ckpts / "tiny-glm4-moe")
    msg = str(e.value)
    assert f"{field}=" in msg and ours in msg and theirs in msg, msg


def test_glm4_moe_router_mismatches_are_named(tiny_ckpts):
    mc = load_model_config("tiny-glm4-moe")
    for changes, match in [({"router_scaling_factor": 1.0}, r"arch\.moe\.router_scaling_factor=1\.0 .*=2\.5"),
                           ({"router_expert_bias": False}, r"arch\.moe\.router_expert_bias=False"),
                           ({"router_score_function": "softmax"}, r"arch\.moe\.router_score_function='softmax'"),
                           ({"first_k_dense": 0}, r"arch\.moe\.first_k_dense=0 .*first_k_dense_replace=1")]:
        bad = mc.model_copy(update={"arch": mc.arch.model_copy(update={"moe": mc.arch.moe.model_copy(update=changes)})})
        with pytest.raises(ConfigError, match=match):
            check_hf_config(bad, tiny_ckpts / "tiny-glm4-moe")


def test_unsupported_model_type_and_missing_config(tiny_ckpts, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_ckpts / "tiny-qwen3", d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="model_type='gpt2' has no mapping"):
        check_hf_config(load_model_config("tiny-qwen3"), d)
    (d / "config.json").unlink()
    with pytest.raises(ConfigError, match="no config.json"):
        check_hf_config(load_model_config("tiny-qwen3"), d)
