"""The released config.json of GLM-4.7-Flash (glm4_moe_lite), MiMo-7B (mimo), MiniMax-M2 (minimax_m2),
Qwen3-Next-80B-A3B (qwen3_next), Qwen3.5-27B (qwen3_5) and Qwen3.5-35B-A3B (qwen3_5_moe) give the model
config slime's models/glm4.7-30B-A3B.sh, models/mimo-7B-rl.sh, models/minimax-m2.sh,
models/qwen3-next-80B-A3B.sh, models/qwen3.5-27B.sh and models/qwen3.5-35B-A3B.sh describe; what the mappings
cannot express is refused in one line naming the field (docs/model-families.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlslurm.errors import ConfigError
from rlslurm.models.model_from_hf import model_config_from_hf
from tests.helpers.released_configs import (
    GLM5,
    GLM47_FLASH,
    MIMO_7B,
    MINIMAX_M2,
    QWEN3_5_27B,
    QWEN3_5_35B_A3B,
    QWEN3_NEXT,
)


def _dir(tmp_path: Path, cfg: dict) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_glm47_flash_is_slimes_glm47_30b_a3b(tmp_path):
    mc = model_config_from_hf(_dir(tmp_path / "GLM-4.7-Flash", GLM47_FLASH))
    a = mc.arch
    assert (mc.hf_model_type, a.num_layers, a.hidden_size, a.ffn_hidden_size, a.num_attention_heads) == (
        "glm4_moe_lite", 47, 2048, 10240, 20)
    assert a.mla.model_dump() == {"q_lora_rank": 768, "kv_lora_rank": 512, "qk_head_dim": 192,
                                  "qk_pos_emb_head_dim": 64, "v_head_dim": 256}
    m = a.moe
    assert (m.num_experts, m.router_topk, m.moe_ffn_hidden_size, m.shared_expert_ffn_hidden_size, m.first_k_dense,
            m.router_score_function, m.router_scaling_factor, m.router_expert_bias) == (
        64, 4, 1536, 1536, 1, "sigmoid", 1.8, True)
    assert (a.rotary_base, a.vocab_size, a.qk_layernorm, a.add_qkv_bias, a.tie_word_embeddings) == (
        1e6, 154880, True, False, False)


@pytest.mark.parametrize("changes,match", [
    # transformers builds 1 dense layer (mlp_layer_types' default) where SGLang builds 2
    ({"first_k_dense_replace": 2}, r"first_k_dense_replace=2 \(SGLang's\) but mlp_layer_types starts with 1 dense"),
    ({"mlp_layer_types": ["dense", "sparse", "dense"] + ["sparse"] * 44},
     r"mlp_layer_types .* is not dense layers followed by sparse ones"),
    ({"attention_bias": True}, r"attention_bias=true, which megatron-core's multi-latent attention does not build"),
    ({"rope_interleave": False}, r"rope_interleave=false"),
])
def test_glm47_flash_variants_megatron_cannot_build_are_refused(tmp_path, changes, match):
    with pytest.raises(ConfigError, match=match) as e:
        model_config_from_hf(_dir(tmp_path / "m", {**GLM47_FLASH, **changes}))
    assert "\n" not in str(e.value) and str(e.value).startswith(f"--hf-checkpoint {tmp_path / 'm'}: ")


def test_mimo_7b_is_slimes_mimo_7b_rl_as_qwen2(tmp_path):
    """Read without remote code, as the Qwen2Config that MiMoConfig subclasses; the MTP layer count
    (num_nextn_predict_layers) changes nothing the trainer builds."""
    mc = model_config_from_hf(_dir(tmp_path / "MiMo-7B-RL", MIMO_7B))
    a = mc.arch
    assert (mc.hf_model_type, mc.hf_architecture) == ("mimo", "MiMoForCausalLM")
    assert (a.num_layers, a.hidden_size, a.ffn_hidden_size, a.num_attention_heads, a.num_query_groups,
            a.kv_channels, a.vocab_size, a.rotary_base, a.norm_epsilon, a.max_position_embeddings) == (
        36, 4096, 11008, 32, 8, 128, 151680, 640000.0, 1e-5, 32768)
    assert a.add_qkv_bias and not a.qk_layernorm and not a.tie_word_embeddings and a.moe is None
    with pytest.raises(ConfigError, match="sliding-window"):
        model_config_from_hf(_dir(tmp_path / "sw", {**MIMO_7B, "use_sliding_window": True, "sliding_window": 4096,
                                                      "max_window_layers": 0}))


def test_minimax_m2_is_slimes_minimax_m2(tmp_path):
    """The release's config.json gives the model slime's models/minimax-m2.sh describes: rotary_dim 64
    of head_dim 128 (--rotary-percent 0.5), every layer MoE over intermediate_size 1536
    (--moe-ffn-hidden-size), and its q/k norm over all heads (slime's own layer spec; rlslurm's
    models/qk_norm.py). Its MTP fields (use_mtp, num_mtp_modules) change nothing the trainer builds."""
    mc = model_config_from_hf(_dir(tmp_path / "MiniMax-M2.5", MINIMAX_M2))
    a, m = mc.arch, mc.arch.moe
    assert (mc.hf_model_type, mc.hf_architecture) == ("minimax_m2", "MiniMaxM2ForCausalLM")
    assert (a.num_layers, a.hidden_size, a.num_attention_heads, a.num_query_groups, a.kv_channels, a.vocab_size,
            a.rotary_percent, a.rotary_base, a.norm_epsilon, a.max_position_embeddings) == (
        62, 3072, 48, 8, 128, 200064, 0.5, 5e6, 1e-6, 196608)
    assert a.qk_layernorm and a.qk_layernorm_all_heads and not a.add_qkv_bias and not a.tie_word_embeddings
    assert (m.num_experts, m.router_topk, m.moe_ffn_hidden_size, m.shared_expert_ffn_hidden_size, m.first_k_dense,
            m.router_score_function, m.router_topk_norm, m.router_scaling_factor, m.router_expert_bias) == (
        256, 8, 1536, 0, 0, "sigmoid", True, 1.0, True)


@pytest.mark.parametrize("changes,match", [
    # switches transformers' MiniMaxM2 ignores (it always builds what the release says): refused, not guessed
    ({"use_qk_norm": False}, r"use_qk_norm=False, but transformers' MiniMaxM2 always builds q_norm/k_norm"),
    ({"qk_norm_type": "per_head"}, r"qk_norm_type='per_head', but .* one q/k norm over all heads"),
    ({"scoring_func": "softmax"}, r"scoring_func='softmax'"),
    ({"use_routing_bias": False}, r"use_routing_bias=False"),
    ({"shared_intermediate_size": 1536}, r"shared_intermediate_size=1536, .* no shared expert"),
    ({"attn_type_list": [0, 1] * 31}, r"attn_type_list entries \[0\] \(not full attention\)"),
])
def test_minimax_m2_variants_transformers_does_not_build_are_refused(tmp_path, changes, match):
    with pytest.raises(ConfigError, match=match) as e:
        model_config_from_hf(_dir(tmp_path / "m", {**MINIMAX_M2, **changes}))
    assert "\n" not in str(e.value) and str(e.value).startswith(f"--hf-checkpoint {tmp_path / 'm'}: ")


def test_qwen3_next_is_slimes_qwen3_next_80b_a3b(tmp_path):
    """The release's config.json gives slime's models/qwen3-next-80B-A3B.sh: 48 layers, every 4th full
    attention (16 heads over 2 KV heads of 256, --attention-output-gate, --qk-layernorm, --rotary-percent
    0.25, --apply-layernorm-1p), the others gated delta nets (16 key heads, 32 value heads of 128), every
    layer MoE (512 experts, top-10 of 512 wide, softmax, one shared expert of 512 behind
    --moe-shared-expert-gate)."""
    mc = model_config_from_hf(_dir(tmp_path / "Qwen3-Next-80B-A3B-Instruct", QWEN3_NEXT))
    a, m, d = mc.arch, mc.arch.moe, mc.arch.gated_delta_net
    assert (mc.hf_model_type, mc.hf_architecture) == ("qwen3_next", "Qwen3NextForCausalLM")
    assert (a.num_layers, a.hidden_size, a.ffn_hidden_size, a.num_attention_heads, a.num_query_groups, a.kv_channels,
            a.vocab_size, a.rotary_percent, a.rotary_base, a.norm_epsilon) == (
        48, 2048, 5120, 16, 2, 256, 151936, 0.25, 1e7, 1e-6)
    assert a.qk_layernorm and a.norm_zero_centered and a.attention_output_gate and not a.add_qkv_bias
    assert (d.full_attention_interval, d.conv_kernel_dim, d.key_head_dim, d.value_head_dim, d.num_key_heads,
            d.num_value_heads) == (4, 4, 128, 128, 16, 32)
    assert (m.num_experts, m.router_topk, m.moe_ffn_hidden_size, m.shared_expert_ffn_hidden_size, m.shared_expert_gate,
            m.first_k_dense, m.router_score_function, m.router_topk_norm, m.router_expert_bias) == (
        512, 10, 512, 512, True, 0, "softmax", True, False)


@pytest.mark.parametrize("changes,match", [
    ({"layer_types": ["linear_attention", "full_attention", "full_attention", "linear_attention"] * 12},
     r"layer_types .* is not every N-th layer full attention"),
    ({"attention_bias": True}, r"attention_bias=true, which gives o_proj a bias too"),
    ({"mlp_only_layers": [3]}, r"mlp_only_layers=\[3\] / decoder_sparse_step=1 put dense layers between MoE layers"),
    ({"shared_expert_intermediate_size": 0}, r"shared_expert_gate needs a shared expert"),
])
def test_qwen3_next_variants_the_model_config_cannot_say_are_refused(tmp_path, changes, match):
    with pytest.raises(ConfigError, match=match) as e:
        model_config_from_hf(_dir(tmp_path / "q", {**QWEN3_NEXT, **changes}))
    assert "\n" not in str(e.value) and str(e.value).startswith(f"--hf-checkpoint {tmp_path / 'q'}: ")


def test_qwen3_next_leading_dense_layers_and_another_interval(tmp_path):
    """mlp_only_layers [0, 1] is two leading dense layers; full_attention_interval 3 is every 3rd."""
    mc = model_config_from_hf(_dir(tmp_path / "q", {**QWEN3_NEXT, "mlp_only_layers": [0, 1],
                                                     "full_attention_interval": 3}))
    assert mc.arch.moe.first_k_dense == 2 and mc.arch.gated_delta_net.full_attention_interval == 3


def test_qwen3_5_27b_is_slimes_qwen3_5_27b(tmp_path):
    """The release's config.json (the language model in text_config) gives slime's models/qwen3.5-27B.sh:
    64 layers, hidden 5120, ffn 17408 (dense), 24 heads over 4 KV heads of 256, --attention-output-gate,
    --apply-layernorm-1p, --rotary-percent 0.25, rotary base 1e7; gated delta nets of 16 key and 48 value
    heads of 128 in 3 of every 4 layers."""
    mc = model_config_from_hf(_dir(tmp_path / "Qwen3.5-27B", QWEN3_5_27B))
    a, d = mc.arch, mc.arch.gated_delta_net
    assert (mc.hf_model_type, mc.hf_architecture) == ("qwen3_5", "Qwen3_5ForConditionalGeneration")
    assert (a.num_layers, a.hidden_size, a.ffn_hidden_size, a.num_attention_heads, a.num_query_groups, a.kv_channels,
            a.vocab_size, a.rotary_percent, a.rotary_base, a.norm_epsilon, a.max_position_embeddings) == (
        64, 5120, 17408, 24, 4, 256, 248320, 0.25, 1e7, 1e-6, 262144)
    assert a.moe is None and a.qk_layernorm and a.norm_zero_centered and a.attention_output_gate
    assert (d.full_attention_interval, d.num_key_heads, d.num_value_heads, d.key_head_dim, d.value_head_dim) == (
        4, 16, 48, 128, 128)


def test_qwen3_5_without_the_output_gate_is_refused(tmp_path):
    cfg = {**QWEN3_5_27B, "text_config": {**QWEN3_5_27B["text_config"], "attn_output_gate": False}}
    with pytest.raises(ConfigError, match=r"attn_output_gate=False, but transformers' Qwen3NextAttention always "
                                          r"builds the output gate") as e:
        model_config_from_hf(_dir(tmp_path / "q", cfg))
    assert "\n" not in str(e.value)


def test_qwen3_5_35b_a3b_is_slimes_qwen3_5_35b_a3b(tmp_path):
    """Qwen3.5-35B-A3B (qwen3_5_moe): slime's models/qwen3.5-35B-A3B.sh, every layer MoE (256 experts, top-8
    of 512, softmax, always renormalised, a shared expert of 512 behind --moe-shared-expert-gate); the
    model config's ffn_hidden_size is the experts' width (the script's --ffn-hidden-size 512)."""
    mc = model_config_from_hf(_dir(tmp_path / "Qwen3.5-35B-A3B", QWEN3_5_35B_A3B))
    a, m, d = mc.arch, mc.arch.moe, mc.arch.gated_delta_net
    assert (mc.hf_model_type, mc.hf_architecture) == ("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration")
    assert (a.num_layers, a.hidden_size, a.ffn_hidden_size, a.num_attention_heads, a.num_query_groups,
            a.kv_channels, a.vocab_size) == (40, 2048, 512, 16, 2, 256, 248320)
    assert (m.num_experts, m.router_topk, m.moe_ffn_hidden_size, m.shared_expert_ffn_hidden_size, m.shared_expert_gate,
            m.first_k_dense, m.router_topk_norm) == (256, 8, 512, 512, True, 0, True)
    assert (d.num_key_heads, d.num_value_heads, d.full_attention_interval) == (16, 32, 4)
def test_glm5_is_slimes_glm5_744b_a40b(tmp_path):
    """GLM-5 (glm_moe_dsa): GLM-4.7-Flash's MLA/MoE fields plus the sparse-attention indexer (32 heads
    of 128, top 2048 keys); its MTP layer (num_nextn_predict_layers) changes nothing the trainer builds."""
    mc = model_config_from_hf(_dir(tmp_path / "GLM-5", GLM5))
    a, m = mc.arch, mc.arch.moe
    assert (mc.hf_model_type, mc.hf_architecture) == ("glm_moe_dsa", "GlmMoeDsaForCausalLM")
    assert (a.num_layers, a.hidden_size, a.ffn_hidden_size, a.num_attention_heads, a.vocab_size, a.rotary_base,
            a.norm_epsilon) == (78, 6144, 12288, 64, 154880, 1e6, 1e-5)
    assert a.mla.model_dump() == {"q_lora_rank": 2048, "kv_lora_rank": 512, "qk_head_dim": 192,
                                  "qk_pos_emb_head_dim": 64, "v_head_dim": 256}
    assert a.dsa.model_dump() == {"index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048, "shared_layers": ()}
    assert (m.num_experts, m.router_topk, m.moe_ffn_hidden_size, m.shared_expert_ffn_hidden_size, m.first_k_dense,
            m.router_score_function, m.router_scaling_factor, m.router_expert_bias) == (
        256, 8, 2048, 2048, 3, "sigmoid", 2.5, True)
    assert a.qk_layernorm and not a.rotary_interleaved and not a.tie_word_embeddings


def test_glm52_shares_top_k_as_slimes_glm52_744b_a40b(tmp_path):
    """GLM-5.2 (slime's run-glm5.2-744B-A40B.sh): index_topk_freq 4 from index_skip_topk_offset 3
    (transformers' GlmMoeDsaConfig turns them into indexer_types): layers 0, 1, 2, 6, 10, ... 74 run
    their indexer (slime's 'computing layers 1, 2, 3, 7, 11, ..., 75', 1-based), the others reuse the
    last one's top-k."""
    mc = model_config_from_hf(_dir(tmp_path / "GLM-5.2", {**GLM5, "index_topk_freq": 4, "index_skip_topk_offset": 3,
                                                           "rope_parameters": {"rope_theta": 8000000}}))
    full = [i for i in range(78) if i not in mc.arch.dsa.shared_layers]
    assert full == [0, 1, 2] + list(range(6, 78, 4)) and mc.arch.rotary_base == 8e6


@pytest.mark.parametrize("changes,match", [
    ({"indexer_types": ["shared"] + ["full"] * 77}, r"dsa.shared_layers=\[0\]: sorted, distinct layers 1..77"),
    ({"indexer_types": ["full"] * 77 + ["dense"]}, r"indexer_types \['full', .*each 'full' or 'shared'"),
    ({"attention_bias": True}, r"attention_bias=true, which megatron-core's multi-latent attention does not build"),
    ({"mlp_layer_types": ["dense"] * 2 + ["sparse"] * 76},
     r"first_k_dense_replace=3 \(SGLang's\) but mlp_layer_types starts with 2 dense"),
    ({"index_head_dim": 96}, r"cannot build: arch: dsa.index_head_dim=96 must be a power of 2"),
])
def test_glm5_variants_megatron_cannot_build_are_refused(tmp_path, changes, match):
    with pytest.raises(ConfigError, match=match) as e:
        model_config_from_hf(_dir(tmp_path / "m", {**GLM5, **changes}))
    assert "\n" not in str(e.value) and str(e.value).startswith(f"--hf-checkpoint {tmp_path / 'm'}: ")
