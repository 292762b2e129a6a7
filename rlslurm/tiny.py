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

from rlslurm.settings.model_config import ModelConfig

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
    """The config.json of a tiny checkpoint: the architecture's (models/hf_config.py hf_from_arch) with
    the tiny tokenizer's special tokens, fp32, and for a vision-language model a one-block vision tower
    (never read by rlslurm)."""
    from rlslurm.models.hf_config import hf_from_arch

    cfg = hf_from_arch(mc, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    cfg["torch_dtype"] = "float32"
    if "text_config" in cfg:
        cfg["vision_config"] = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                                "out_hidden_size": mc.arch.hidden_size, "patch_size": 16, "spatial_merge_size": 2,
                                "temporal_patch_size": 2, "num_position_embeddings": 16}
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

    from rlslurm.models.family import remote_base

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg_dict = hf_config_dict(mc)
    model_type = cfg_dict.pop("model_type")
    # a remote-code config class (MiMo's): the main model is the transformers class it subclasses
    config = AutoConfig.for_model(remote_base(model_type) or model_type, **cfg_dict)
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
