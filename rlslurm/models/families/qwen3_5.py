"""Qwen3.5 (dense, e.g. Qwen3.5-27B): Qwen3-Next's layers with a dense MLP everywhere and the gated
delta net's in_proj split in four, inside a vision-language model (Qwen3_5ForConditionalGeneration)
whose `text_config` holds the language model's fields and whose language model's tensors are under
`model.language_model.`; the vision tower is never loaded, trained or exported
(docs/model-families.md, "Qwen3.5")."""

from __future__ import annotations

import json
from typing import Any

from rlslurm.models.families import qwen3_next
from rlslurm.models.family import Family, Field

LANGUAGE_MODEL = "model.language_model."


def to_hf(mc: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """Multimodal rotary: its sections over the rotary dims' frequencies (t, h, w), which text-only
    positions make plain rotary."""
    a = mc.arch
    half = int(a.kv_channels * a.rotary_percent) // 2
    cfg.pop("rope_theta", None)
    cfg.pop("partial_rotary_factor", None)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": a.rotary_base,
                              "partial_rotary_factor": a.rotary_percent, "mrope_interleaved": True,
                              "mrope_section": [half // 3, half // 3, half - 2 * (half // 3)]}
    return cfg


FIELDS = (Field("add_qkv_bias", "attention_bias", compared=False, read=lambda hf: bool(hf("attention_bias", False))),)

# Qwen3.5's image processor (Qwen3-VL's: patches of 16 over 2 frames, 2x2 merged), for the one-block
# vision tower rlslurm/tiny.py writes; text-only prompts never reach it.
PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor", "patch_size": 16,
    "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
}


def checkpoint_extras(out: Any, config_json: dict[str, Any], hf_config: Any, dtype: Any, seed: int) -> None:
    """A vision-language model: SGLang loads its multimodal processor at start (AutoProcessor), which
    needs the image processor's config beside the weights, as the release ships it."""
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))


FAMILY = Family(
    name="qwen3_5",
    fixed=qwen3_next.FIXED,
    fields=FIELDS,
    blocks=(qwen3_next.GATED_DELTA_NET,),
    refuse=qwen3_next.refuse,
    to_hf=to_hf,
    text_config=True,
    hf_prefix=LANGUAGE_MODEL,
    layer_rules=qwen3_next.layer_rules_for(split_in_proj=True),
    layer_spec=qwen3_next.layer_spec,
    checkpoint_extras=checkpoint_extras,
)
