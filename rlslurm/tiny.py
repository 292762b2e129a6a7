"""Tiny random-init HF checkpoints for CPU tests and the demo.

`make_tiny_checkpoint(model_config, out_dir)` writes a real HF model directory (config.json,
model.safetensors, tokenizer.json + tokenizer_config.json) built with transformers from the
model config's architecture, so every component (Megatron load, SGLang server, router, weight
sync) runs on genuine files, with no hub download. The tokenizer is word-level over a fixed
64-token vocabulary: whitespace-separated letters, digits and a few task words.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlslurm.settings.model_config import ModelConfig, MoEArch

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
WORDS = (
    SPECIAL_TOKENS
    + list("abcdefghijklmnopqrstuvwxyz")
    + list("0123456789")
    + ["say", "copy", "count", "add", "reverse", "digits", "letters", "answer", ":", "=", "+", "-",
       "?", ".", ",", "(", ")", "the", "is", "user", "assistant", "tool", "call", "result"]
)
assert len(WORDS) == 64, len(WORDS)
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)


def tokenizer_json() -> dict:
    vocab = {w: i for i, w in enumerate(WORDS)}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for i, t in enumerate(SPECIAL_TOKENS)
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": False},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }


def hf_config_dict(mc: ModelConfig) -> dict:
    """The HF config.json for a model config's architecture (every mapped family)."""
    a = mc.arch
    cfg = {
        "architectures": [mc.hf_architecture],
        "model_type": mc.hf_model_type,
        "vocab_size": a.vocab_size,
        "hidden_size": a.hidden_size,
        "intermediate_size": a.ffn_hidden_size,
        "num_hidden_layers": a.num_layers,
        "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": a.num_query_groups,
        "head_dim": a.kv_channels,
        "max_position_embeddings": a.max_position_embeddings,
        "rms_norm_eps": a.norm_epsilon,
        "rope_theta": a.rotary_base,
        "tie_word_embeddings": a.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": a.add_qkv_bias,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "torch_dtype": "float32",
    }
    if a.rotary_percent != 1.0:
        cfg["partial_rotary_factor"] = a.rotary_percent
    if a.rope_scaling is not None:
        rs = a.rope_scaling.model_dump(exclude_none=True)
        cfg["rope_scaling"] = {"rope_type": rs.pop("type"), **rs}
    if mc.hf_model_type in ("qwen2", "mimo"):
        del cfg["attention_bias"]  # Qwen2 has no such field: its q/k/v biases are always there
    if mc.hf_model_type == "mimo":
        # MiMo-7B's config.json: Qwen2's fields, MiMoConfig's num_nextn_predict_layers (1 MTP layer,
        # written by make_tiny_checkpoint) and its auto_map to the remote code (not shipped here)
        cfg.update(num_nextn_predict_layers=1, auto_map={"AutoConfig": "configuration_mimo.MiMoConfig",
                                                         "AutoModelForCausalLM": "modeling_mimo.MiMoForCausalLM"})
    if mc.hf_model_type == "qwen3_moe" and a.moe:
        cfg.update(num_experts=a.moe.num_experts, num_experts_per_tok=a.moe.router_topk,
                   moe_intermediate_size=a.moe.moe_ffn_hidden_size, norm_topk_prob=a.moe.router_topk_norm,
                   decoder_sparse_step=1, mlp_only_layers=[])
    if mc.hf_model_type in ("deepseek_v3", "glm4_moe_lite") and a.moe and a.mla:
        m, l = a.moe, a.mla
        del cfg["head_dim"], cfg["attention_bias"]  # DeepSeek derives head_dim from the rope dim
        cfg.update(
            **_deepseek_style_moe(m), q_lora_rank=l.q_lora_rank, kv_lora_rank=l.kv_lora_rank,
            qk_nope_head_dim=l.qk_head_dim, qk_rope_head_dim=l.qk_pos_emb_head_dim, v_head_dim=l.v_head_dim,
            num_nextn_predict_layers=0, rope_interleave=True,
        )
    if mc.hf_model_type == "deepseek_v3" and a.moe:
        # DeepSeek-V3's and Moonlight's config.json carry these; transformers' DeepseekV3Config has no
        # such fields and SGLang 0.5.14's deepseek_v2.py reads them unguarded (docs/model-families.md,
        # "What SGLang 0.5.14 serves on a GPU")
        cfg.update(_deepseek_v3_router_fields(a.moe))
    if mc.hf_model_type == "glm4_moe_lite" and a.moe:
        # transformers builds the layers from mlp_layer_types, SGLang from first_k_dense_replace
        # (which _deepseek_style_moe wrote): both, as GLM-4.7-Flash's loaders read one or the other
        cfg["mlp_layer_types"] = ["dense"] * a.moe.first_k_dense + ["sparse"] * (a.num_layers - a.moe.first_k_dense)
    if mc.hf_model_type == "glm_moe_dsa" and a.moe and a.mla and a.dsa:
        # GLM-5's config.json: DeepSeek-V3's MLA/MoE fields (no rope_interleave field: GLM-5 always
        # interleaves; head_dim is derived from the rope dim), mlp_layer_types and
        # first_k_dense_replace both (transformers reads the first, SGLang the second), the indexer's
        # sizes, and which layers reuse an earlier layer's top-k (indexer_types "shared": GLM-5.2's)
        m, l, d = a.moe, a.mla, a.dsa
        del cfg["head_dim"], cfg["attention_bias"]
        cfg.update(
            **_deepseek_style_moe(m), q_lora_rank=l.q_lora_rank, kv_lora_rank=l.kv_lora_rank,
            qk_nope_head_dim=l.qk_head_dim, qk_rope_head_dim=l.qk_pos_emb_head_dim, v_head_dim=l.v_head_dim,
            mlp_layer_types=["dense"] * m.first_k_dense + ["sparse"] * (a.num_layers - m.first_k_dense),
            index_n_heads=d.index_n_heads, index_head_dim=d.index_head_dim, index_topk=d.index_topk,
            indexer_types=["shared" if i in d.shared_layers else "full" for i in range(a.num_layers)],
            # SGLang builds GLM-5 as DeepSeek-V3 (deepseek_v2.py), which reads these unguarded; SGLang
            # 0.5.14 knows the shared layers as index_topk_pattern only ("S": reuse the top-k), 0.5.23
            # reads indexer_types first (docs/model-families.md, "What SGLang 0.5.14 serves on a GPU")
            **_deepseek_v3_router_fields(m),
            index_topk_pattern="".join("S" if i in d.shared_layers else "F" for i in range(a.num_layers)),
        )
    if mc.hf_model_type == "glm4_moe" and a.moe:
        m = a.moe
        cfg.update(
            **_deepseek_style_moe(m), use_qk_norm=a.qk_layernorm,
            # transformers' default is 0.5, not 1: always spell it out
            partial_rotary_factor=a.rotary_percent, num_nextn_predict_layers=0,
        )
    if mc.hf_model_type == "minimax_m2" and a.moe:
        # the release's config.json spells partial rotary as rotary_dim (transformers 5.19's
        # MiniMaxM2Config turns it into partial_rotary_factor) and carries the switches below, which
        # transformers ignores and check_hf_config pins; no attention_bias field. Every layer is MoE:
        # intermediate_size is each expert's width.
        del cfg["attention_bias"]
        cfg.update(intermediate_size=a.moe.moe_ffn_hidden_size, num_local_experts=a.moe.num_experts,
                   num_experts_per_tok=a.moe.router_topk, rotary_dim=int(a.kv_channels * a.rotary_percent),
                   use_qk_norm=True, qk_norm_type="per_layer", scoring_func="sigmoid", use_routing_bias=True,
                   shared_intermediate_size=0, attn_type_list=[1] * a.num_layers)
    if mc.hf_model_type in ("qwen3_5", "qwen3_5_moe"):
        # a vision-language model (Qwen3_5ForConditionalGeneration): the language model's fields in
        # text_config, a one-block vision tower beside it (never read by rlslurm); the hybrid layers as
        # qwen3_next's. Multimodal rotary: its sections over the rotary dims' frequencies
        # (t, h, w), which text-only positions make plain rotary.
        d = a.gated_delta_net
        half = int(a.kv_channels * a.rotary_percent) // 2
        text = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype", "rope_theta")}
        text.update(
            rope_parameters={"rope_type": "default", "rope_theta": a.rotary_base,
                             "partial_rotary_factor": a.rotary_percent, "mrope_interleaved": True,
                             "mrope_section": [half // 3, half // 3, half - 2 * (half // 3)]},
            layer_types=["linear_attention" if (i + 1) % d.full_attention_interval else "full_attention"
                         for i in range(a.num_layers)],
            full_attention_interval=d.full_attention_interval,
            linear_conv_kernel_dim=d.conv_kernel_dim, linear_key_head_dim=d.key_head_dim,
            linear_value_head_dim=d.value_head_dim, linear_num_key_heads=d.num_key_heads,
            linear_num_value_heads=d.num_value_heads)
        text.pop("partial_rotary_factor", None)
        if mc.hf_model_type == "qwen3_5_moe":  # every layer Qwen3-Next's MoE block, no dense MLP
            m = a.moe
            del text["intermediate_size"]
            text.update(num_experts=m.num_experts, num_experts_per_tok=m.router_topk,
                        moe_intermediate_size=m.moe_ffn_hidden_size,
                        shared_expert_intermediate_size=m.shared_expert_ffn_hidden_size)
        return {"architectures": [mc.hf_architecture], "model_type": mc.hf_model_type, "text_config": text,
                "vision_config": {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                                  "out_hidden_size": a.hidden_size, "patch_size": 16, "spatial_merge_size": 2,
                                  "temporal_patch_size": 2, "num_position_embeddings": 16},
                "tie_word_embeddings": a.tie_word_embeddings, "torch_dtype": "float32"}
    if mc.hf_model_type == "qwen3_next":
        # Qwen3NextConfig: partial_rotary_factor defaults to 0.25, so always spelt out; the hybrid
        # layers as layer_types; dense layers as mlp_only_layers (rlslurm expresses leading ones)
        d, m = a.gated_delta_net, a.moe
        cfg.update(partial_rotary_factor=a.rotary_percent, full_attention_interval=d.full_attention_interval,
                   layer_types=["linear_attention" if (i + 1) % d.full_attention_interval else "full_attention"
                                for i in range(a.num_layers)],
                   linear_conv_kernel_dim=d.conv_kernel_dim, linear_key_head_dim=d.key_head_dim,
                   linear_value_head_dim=d.value_head_dim, linear_num_key_heads=d.num_key_heads,
                   linear_num_value_heads=d.num_value_heads)
        if m:
            cfg.update(num_experts=m.num_experts, num_experts_per_tok=m.router_topk,
                       moe_intermediate_size=m.moe_ffn_hidden_size,
                       shared_expert_intermediate_size=m.shared_expert_ffn_hidden_size,
                       norm_topk_prob=m.router_topk_norm, decoder_sparse_step=1,
                       mlp_only_layers=list(range(m.first_k_dense)))
        else:
            cfg.update(num_experts=0)
    return cfg


# Qwen3-Next's MTP module as the release stores it (SGLang 0.5.23 qwen3_next.py load_weights reads
# these names when is_mtp): a few of its tensors, so tests see what the trainer does with tensors
# it has no rule for (transformers' Qwen3NextPreTrainedModel ignores `^mtp.*` on load).
def _qwen3_next_mtp_shapes(h: int) -> dict[str, tuple[int, ...]]:
    return {"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
            "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,),
            "mtp.layers.0.input_layernorm.weight": (h,)}


def _add_tensors(out: Path, shapes: dict[str, tuple[int, ...]], dtype: Any, seed: int) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(seed + 1)
    path = out / "model.safetensors"
    tensors = load_file(path)
    for name, shape in shapes.items():
        tensors[name] = (torch.randn(*shape, generator=g) * 0.02).to(dtype)
    save_file(tensors, path, metadata={"format": "pt"})


def _deepseek_style_moe(m: MoEArch) -> dict[str, Any]:
    """HF config fields of DeepSeek-V3's MoE, which glm4_moe spells the same way."""
    return dict(
        n_routed_experts=m.num_experts, num_experts_per_tok=m.router_topk, moe_intermediate_size=m.moe_ffn_hidden_size,
        n_shared_experts=m.shared_expert_ffn_hidden_size // m.moe_ffn_hidden_size,
        first_k_dense_replace=m.first_k_dense, norm_topk_prob=m.router_topk_norm,
        routed_scaling_factor=m.router_scaling_factor, n_group=m.router_num_groups, topk_group=m.router_group_topk,
    )


def _deepseek_v3_router_fields(m: MoEArch) -> dict[str, Any]:
    """The router fields of DeepSeek-V3's config.json that transformers drops and SGLang reads: every
    layer after the leading dense ones is MoE (moe_layer_freq 1), scored by the router's function,
    with the correction bias (noaux_tc)."""
    return dict(moe_layer_freq=1, scoring_func=m.router_score_function,
                topk_method="noaux_tc" if m.router_expert_bias else "greedy")


# Qwen3.5's image processor (Qwen3-VL's: patches of 16 over 2 frames, 2x2 merged), for the one-block
# vision tower rlslurm.tiny writes; text-only prompts never reach it.
QWEN3_5_PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor", "patch_size": 16,
    "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
}

# MiMo's config class as the release's auto_map names it (configuration_mimo.MiMoConfig): Qwen2's
# fields plus the MTP layer count. Written by rlslurm (the release's own file is not shipped here);
# SGLang loads it with --trust-remote-code, which a mimo config.json needs (AutoConfig refuses
# model_type mimo without it).
MIMO_CONFIG_CODE = """\
from transformers import Qwen2Config


class MiMoConfig(Qwen2Config):
    model_type = "mimo"

    def __init__(self, num_nextn_predict_layers=0, **kwargs):
        self.num_nextn_predict_layers = num_nextn_predict_layers
        super().__init__(**kwargs)
"""


def _add_mimo_mtp_layer(out: Path, cfg: Any, dtype: Any, seed: int) -> None:
    """Append MiMo's MTP layer 0 to the checkpoint, named and shaped as SGLang's mimo_mtp.py loads it
    (`model.mtp_layers.0.`: token/hidden/final norms, input_proj [h, 2h], and one Qwen2 decoder
    layer's 12 tensors), so tests see what the trainer does with tensors it has no rule for."""
    import torch
    from safetensors.torch import load_file, save_file

    h, f = cfg.hidden_size, cfg.intermediate_size
    d = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes = {"token_layernorm.weight": (h,), "hidden_layernorm.weight": (h,), "final_layernorm.weight": (h,),
              "input_proj.weight": (h, 2 * h), "input_layernorm.weight": (h,),
              "post_attention_layernorm.weight": (h,), "self_attn.q_proj.weight": (q, h), "self_attn.q_proj.bias": (q,),
              "self_attn.k_proj.weight": (kv, h), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.weight": (kv, h),
              "self_attn.v_proj.bias": (kv,), "self_attn.o_proj.weight": (h, q), "mlp.gate_proj.weight": (f, h),
              "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)}
    g = torch.Generator().manual_seed(seed + 1)
    path = out / "model.safetensors"
    tensors = load_file(path)
    for name, shape in shapes.items():
        tensors[f"model.mtp_layers.0.{name}"] = (torch.randn(*shape, generator=g) * 0.02).to(dtype)
    save_file(tensors, path, metadata={"format": "pt"})


def make_tiny_checkpoint(mc: ModelConfig, out_dir: str | Path, *, seed: int = 0, dtype: str = "float32",
                         device: str = "cpu") -> Path:
    """Write a random-init HF checkpoint for `mc` into `out_dir` (created); returns the path.
    `dtype`/`device`: a full-size shape (benches) is built on the GPU and written in bf16."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg_dict = hf_config_dict(mc)
    model_type = cfg_dict.pop("model_type")
    # MiMo: the main model is transformers' Qwen2 (MiMo's own classes are remote code)
    config = AutoConfig.for_model({"mimo": "qwen2"}.get(model_type, model_type), **cfg_dict)
    torch.manual_seed(seed)
    with torch.device(device):
        # a vision-language model (Qwen3.5): the whole model, so the file holds its names and tower
        auto = AutoModelForImageTextToText if hasattr(config, "text_config") else AutoModelForCausalLM
        model = auto.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # non-trivial norms so a norm mapped to the wrong tensor shows in logits
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():  # DeepSeek's router correction bias is a buffer
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn_like(b) * 0.1)
    from transformers.utils import logging as hf_logging

    # transformers' "Writing model shards" bar, for the one shard of a tiny model, was the first thing
    # `rlslurm run --demo` printed
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.to(getattr(torch, dtype)).save_pretrained(out, safe_serialization=True)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    if model_type == "qwen3_next":
        _add_tensors(out, _qwen3_next_mtp_shapes(model.config.hidden_size), getattr(torch, dtype), seed)
    if model_type == "mimo":
        _add_mimo_mtp_layer(out, model.config, getattr(torch, dtype), seed)
        (out / "config.json").write_text(json.dumps({**cfg_dict, "model_type": "mimo"}, indent=1))
        # the config class its auto_map names: SGLang reads config.json through it (--trust-remote-code)
        (out / "configuration_mimo.py").write_text(MIMO_CONFIG_CODE)
    if model_type in ("qwen3_5", "qwen3_5_moe"):
        # a vision-language model: SGLang loads its multimodal processor at start (AutoProcessor), which
        # needs the image processor's config beside the weights, as the release ships it
        (out / "preprocessor_config.json").write_text(json.dumps(QWEN3_5_PREPROCESSOR))
    (out / "tokenizer.json").write_text(json.dumps(tokenizer_json()))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
        "model_max_length": mc.arch.max_position_embeddings,
        "chat_template": "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}assistant : {% endif %}",
    }))
    return out
