"""Xiaomi MiMo-7B: a Qwen2 model plus MTP layers (`model.mtp_layers.*`) that the mapping leaves out:
never loaded, trained or exported; the engine's MTP drafter keeps the checkpoint's. Its config class
is remote code (configuration_mimo.MiMoConfig: Qwen2Config plus num_nextn_predict_layers), read here
as Qwen2's (docs/model-families.md, "MiMo-7B (`mimo`, MiMoForCausalLM)")."""

from __future__ import annotations

import json
from typing import Any

from rlslurm.models.families import qwen2
from rlslurm.models.family import Family
from rlslurm.models.random_tensors import add_random_tensors


def to_hf(mc: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen2's fields, MiMoConfig's num_nextn_predict_layers (one MTP layer) and the auto_map to the
    remote code."""
    cfg.pop("attention_bias", None)
    cfg.update(num_nextn_predict_layers=1, auto_map={"AutoConfig": "configuration_mimo.MiMoConfig",
                                                     "AutoModelForCausalLM": "modeling_mimo.MiMoForCausalLM"})
    return cfg


# MiMo's config class as the release's auto_map names it (configuration_mimo.MiMoConfig): Qwen2's
# fields plus the MTP layer count. Written by rlslurm (the release's own file is not shipped here);
# SGLang loads it with --trust-remote-code, which a mimo config.json needs (AutoConfig refuses
# model_type mimo without it).
CONFIG_CODE = """\
from transformers import Qwen2Config


class MiMoConfig(Qwen2Config):
    model_type = "mimo"

    def __init__(self, num_nextn_predict_layers=0, **kwargs):
        self.num_nextn_predict_layers = num_nextn_predict_layers
        super().__init__(**kwargs)
"""


def mtp_layer_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """MiMo's MTP layer 0, named and shaped as SGLang's mimo_mtp.py loads it (`model.mtp_layers.0.`:
    token/hidden/final norms, input_proj [h, 2h], and one Qwen2 decoder layer's 12 tensors)."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    d = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes = {"token_layernorm.weight": (h,), "hidden_layernorm.weight": (h,), "final_layernorm.weight": (h,),
              "input_proj.weight": (h, 2 * h), "input_layernorm.weight": (h,),
              "post_attention_layernorm.weight": (h,), "self_attn.q_proj.weight": (q, h), "self_attn.q_proj.bias": (q,),
              "self_attn.k_proj.weight": (kv, h), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.weight": (kv, h),
              "self_attn.v_proj.bias": (kv,), "self_attn.o_proj.weight": (h, q), "mlp.gate_proj.weight": (f, h),
              "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)}
    return {f"model.mtp_layers.0.{name}": shape for name, shape in shapes.items()}


def checkpoint_extras(out: Any, config_json: dict[str, Any], hf_config: Any, dtype: Any, seed: int) -> None:
    """The MTP layer (no rule maps it), config.json as `mimo` (transformers saved it as the Qwen2 it
    was built as) and the config class its auto_map names: SGLang reads config.json through it."""
    add_random_tensors(out, mtp_layer_shapes(hf_config), dtype, seed)
    (out / "config.json").write_text(json.dumps(config_json, indent=1))
    (out / "configuration_mimo.py").write_text(CONFIG_CODE)


FAMILY = Family(name="mimo", remote_base="qwen2", fixed=qwen2.FIXED, layer_rules=qwen2.layer_rules, to_hf=to_hf,
                checkpoint_extras=checkpoint_extras)
