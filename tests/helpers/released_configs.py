"""config.json dicts of the families slime's scripts name, written from fields public sources pin (each
dict says which): the fixtures of tests/convert/test_hf_config_slime_families.py and of the file-only
comparison a login node without transformers makes (tests/launcher/test_core_install.py). These are not
release files: the releases' own config.json files, copied as released, are in
tests/fixtures/release_configs/ (its README names each source), and tests/convert/test_release_configs.py
checks that the dicts here give the same model config as the release files of the same architecture."""

# GLM-4.7-Flash's config.json as vLLM's test of its glm4_moe_lite config pins it (the model card's file
# was not reachable from here); the sizes agree with slime's scripts/models/glm4.7-30B-A3B.sh.
GLM47_FLASH = {
    "architectures": ["Glm4MoeLiteForCausalLM"], "model_type": "glm4_moe_lite", "vocab_size": 154880,
    "hidden_size": 2048, "intermediate_size": 10240, "moe_intermediate_size": 1536, "num_hidden_layers": 47,
    "num_attention_heads": 20, "num_key_value_heads": 20, "hidden_act": "silu", "rms_norm_eps": 1e-5,
    "attention_dropout": 0.0, "attention_bias": False, "max_position_embeddings": 202752, "rope_theta": 1_000_000.0,
    "rope_scaling": None, "partial_rotary_factor": 1.0, "q_lora_rank": 768, "kv_lora_rank": 512,
    "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256, "n_routed_experts": 64,
    "n_shared_experts": 1, "num_experts_per_tok": 4, "norm_topk_prob": True, "routed_scaling_factor": 1.8,
    "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "first_k_dense_replace": 1,
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}

# MiMo-7B-RL's config.json as Megatron-Bridge's MiMo test pins it, plus the auto_map of the release
# (its config and model classes are remote code); the sizes agree with slime's models/mimo-7B-rl.sh.
MIMO_7B = {
    "architectures": ["MiMoForCausalLM"], "model_type": "mimo", "attention_bias": True, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_mimo.MiMoConfig", "AutoModel": "modeling_mimo.MiMoModel",
                 "AutoModelForCausalLM": "modeling_mimo.MiMoForCausalLM"},
    "bos_token_id": 151643, "eos_token_id": 151645, "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 11008, "max_position_embeddings": 32768, "num_attention_heads": 32,
    "num_hidden_layers": 36, "num_key_value_heads": 8, "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-05,
    "rope_theta": 640000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 151680,
}


# MiniMax-M2's config.json as released (MiniMaxAI/MiniMax-M2; the model card's file was not reachable
# from here: the values are those that public test fixtures and inference engines' ports pin, and agree
# with slime's scripts/models/minimax-m2.sh); its fp8 quantization_config left out (convert/fp8.py reads it).
MINIMAX_M2 = {
    "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "attn_type_list": [1] * 62,
    "auto_map": {"AutoConfig": "configuration_minimax_m2.MiniMaxM2Config",
                 "AutoModelForCausalLM": "modeling_minimax_m2.MiniMaxM2ForCausalLM"},
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 3072, "intermediate_size": 1536,
    "max_position_embeddings": 196608, "mtp_transformer_layers": 1, "num_attention_heads": 48,
    "num_experts_per_tok": 8, "num_hidden_layers": 62, "num_key_value_heads": 8, "num_local_experts": 256,
    "num_mtp_modules": 3, "qk_norm_type": "per_layer", "rms_norm_eps": 1e-06, "rope_theta": 5000000,
    "rotary_dim": 64, "scoring_func": "sigmoid", "shared_intermediate_size": 0, "tie_word_embeddings": False,
    "use_cache": True, "use_mtp": True, "use_qk_norm": True, "use_routing_bias": True, "vocab_size": 200064,
    "torch_dtype": "bfloat16",
}


# Qwen3-Next-80B-A3B-Instruct's config.json (Qwen/Qwen3-Next-80B-A3B-Instruct; the model card's file was
# not reachable from here: the values are those public test fixtures pin for this architecture, and they
# agree with slime's scripts/models/qwen3-next-80B-A3B.sh and transformers 5.19's Qwen3NextConfig
# defaults); the MTP fields are the release's, which transformers ignores.
QWEN3_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "decoder_sparse_step": 1,
    "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 5120, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
    "max_position_embeddings": 262144, "mlp_only_layers": [], "moe_intermediate_size": 512, "norm_topk_prob": True,
    "num_attention_heads": 16, "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 48,
    "num_key_value_heads": 2, "output_router_logits": False, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 10000000, "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 151936,
    "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
}


# Qwen3.5-27B's config.json (Qwen/Qwen3.5-27B; not reachable from here: the values public test fixtures pin
# for it, which agree with slime's scripts/models/qwen3.5-27B.sh), its vision_config cut to the fields
# transformers needs (rlslurm reads none of it).
QWEN3_5_27B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "image_token_id": 248056,
    "language_model_only": False, "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_text", "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True,
        "bos_token_id": 248044, "eos_token_id": 248044, "dtype": "bfloat16", "full_attention_interval": 4,
        "head_dim": 256, "hidden_act": "silu", "hidden_size": 5120, "initializer_range": 0.02,
        "intermediate_size": 17408, "layer_types": ["linear_attention"] * 3 * 1 + ["full_attention"],
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 48, "linear_value_head_dim": 128, "max_position_embeddings": 262144,
        "mtp_num_hidden_layers": 1, "num_attention_heads": 24, "num_hidden_layers": 64, "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "vocab_size": 248320,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                            "rope_theta": 10000000, "partial_rotary_factor": 0.25},
    },
    "vision_config": {"model_type": "qwen3_5", "depth": 27, "hidden_size": 1152, "intermediate_size": 4304,
                      "num_heads": 16, "out_hidden_size": 5120, "patch_size": 16, "spatial_merge_size": 2,
                      "temporal_patch_size": 2, "num_position_embeddings": 2304},
}
QWEN3_5_27B["text_config"]["layer_types"] = (["linear_attention"] * 3 + ["full_attention"]) * 16

# Qwen3.5-35B-A3B's (Qwen/Qwen3.5-35B-A3B; as public fixtures pin it, agreeing with slime's
# scripts/models/qwen3.5-35B-A3B.sh): no intermediate_size (no dense MLP), 256 experts top-8 of 512, one
# shared expert of 512.
QWEN3_5_35B_A3B = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe", "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_moe_text", "attention_bias": False, "attn_output_gate": True, "dtype": "bfloat16",
        "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 10, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_value_head_dim": 128, "max_position_embeddings": 262144, "moe_intermediate_size": 512,
        "mtp_num_hidden_layers": 1, "num_attention_heads": 16, "num_experts": 256, "num_experts_per_tok": 8,
        "num_hidden_layers": 40, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
        "shared_expert_intermediate_size": 512, "tie_word_embeddings": False, "vocab_size": 248320,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                            "rope_theta": 10000000, "partial_rotary_factor": 0.25},
    },
    "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                      "out_hidden_size": 2048, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                      "num_position_embeddings": 2304},
}


# GLM-5's config.json: the values transformers 5.19's GlmMoeDsaConfig documents as zai-org/GLM-5 (its
# defaults) with slime's scripts/models/glm5-744B-A40B.sh rope base (the model card's file was not
# reachable from here; the sizes agree with that script: 78 layers of which 3 dense, hidden 6144, 64
# heads, q LoRA 2048, kv LoRA 512, qk 192 + 64 rope, v 256, 256 experts top-8 of 2048, one shared,
# scaling 2.5, vocab 154880).
GLM5 = {
    "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "vocab_size": 154880,
    "hidden_size": 6144, "intermediate_size": 12288, "moe_intermediate_size": 2048, "num_hidden_layers": 78,
    "num_attention_heads": 64, "num_key_value_heads": 64, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 2048, "qk_rope_head_dim": 64,
    "v_head_dim": 256, "qk_nope_head_dim": 192, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "hidden_act": "silu", "max_position_embeddings": 202752, "rms_norm_eps": 1e-5,
    "attention_bias": False, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32,
    "first_k_dense_replace": 3, "num_nextn_predict_layers": 1, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"}, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
