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


def make_tiny_checkpoint(mc: ModelConfig, out_dir: str | Path, *, seed: int = 0, dtype: str = "float32",
                         device: str = "cpu") -> Path:
    """Write a random-init HF checkpoint for `mc` into `out_dir` (created); returns the path.
    `dtype`/`device`: a full-size shape (benches) is built on the GPU and written in bf16."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from rlslurm.models.family import family_of, remote_base

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
    family = family_of(model_type)
    if family is not None and family.checkpoint_extras is not None:
        family.checkpoint_extras(out, {**cfg_dict, "model_type": model_type}, model.config, getattr(torch, dtype), seed)
    (out / "tokenizer.json").write_text(json.dumps(tokenizer_json()))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
        "model_max_length": mc.arch.max_position_embeddings,
        "chat_template": "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}assistant : {% endif %}",
    }))
    return out
