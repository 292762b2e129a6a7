"""Xiaomi MiMo-7B: a Qwen2 model plus MTP layers (`model.mtp_layers.*`) that the mapping leaves out:
never loaded, trained or exported; the engine's MTP drafter keeps the checkpoint's. Its config class
is remote code (configuration_mimo.MiMoConfig: Qwen2Config plus num_nextn_predict_layers), read here
as Qwen2's (docs/model-families.md, "MiMo-7B (`mimo`, MiMoForCausalLM)")."""

from __future__ import annotations

from typing import Any

from rlslurm.models.families import qwen2
from rlslurm.models.family import Family


def to_hf(mc: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen2's fields, MiMoConfig's num_nextn_predict_layers (one MTP layer) and the auto_map to the
    remote code."""
    cfg.pop("attention_bias", None)
    cfg.update(num_nextn_predict_layers=1, auto_map={"AutoConfig": "configuration_mimo.MiMoConfig",
                                                     "AutoModelForCausalLM": "modeling_mimo.MiMoForCausalLM"})
    return cfg


FAMILY = Family(name="mimo", remote_base="qwen2", fixed=qwen2.FIXED, layer_rules=qwen2.layer_rules, to_hf=to_hf)
