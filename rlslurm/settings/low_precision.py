"""Low precision, never silently dropped (issue 32 item 6; the facts: docs/low-precision.md).

Training: megatron-core's FP8/FP4 paths run inside transformer-engine's layers, and rlslurm's
stacks have no transformer-engine (it does not build on CPU, docs/megatron-cpu.md, and the GPU
image does not install it), so rlslurm trains in bf16/fp32 only. slime's precision flags and the
matching `--megatron-*` fields are refused with that reason instead of passing through to a trainer
that would ignore them or fail inside megatron.

Checkpoints: a `--hf-checkpoint` whose config.json has a `quantization_config` (Qwen's *-FP8
releases, slime's INT4 recipes) holds quantized weights plus their scales. rlslurm's HF loader and
converter read plain bf16/fp32 tensors, and its weight sync sends the trainer's unquantized weights
to the engines, so neither side can use it: it is refused at submit, naming the method.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlslurm.errors import ConfigError

DOC = "docs/low-precision.md"
WHY_TRAINING = (f"FP8/FP4 training runs in transformer-engine's layers, and rlslurm's trainer has no "
                f"transformer-engine (it trains in --bf16 or fp32; {DOC})")

# slime / Megatron-LM command-line flags (field form) of low-precision training
SLIME_FLAGS = ("fp8_format", "fp8_recipe", "fp8_margin", "fp8_interval", "fp8_amax_history_len",
               "fp8_amax_compute_algo", "fp8_param_gather", "fp8_dot_product_attention",
               "fp8_multi_head_attention", "no_fp8_weight_transpose_cache", "fp4_format", "fp4_recipe",
               "fp4_param_gather", "first_last_layers_bf16", "num_layers_at_start_in_bf16",
               "num_layers_at_end_in_bf16")
# the megatron-core TransformerConfig fields they set (transformer_config.py), as --megatron-<field>
MEGATRON_FIELDS = ("fp8", "fp8_recipe", "fp8_margin", "fp8_interval", "fp8_amax_history_len",
                   "fp8_amax_compute_algo", "fp8_wgrad", "fp8_dot_product_attention", "fp8_multi_head_attention",
                   "fp8_param", "tp_only_amax_red", "first_last_layers_bf16", "num_layers_at_start_in_bf16",
                   "num_layers_at_end_in_bf16", "fp4", "fp4_recipe", "fp4_param")


def check_megatron_precision(megatron: dict) -> None:
    """Refuse `--megatron-<field>` of FP8/FP4 training (a false/None value asks for nothing)."""
    for key, value in megatron.items():
        if key in MEGATRON_FIELDS and value not in (None, False, "none", "None"):
            raise ConfigError(f"--megatron-{key.replace('_', '-')} {value}: {WHY_TRAINING}")


def quantization(hf_dir: Path) -> dict | None:
    """config.json's `quantization_config` (None when absent or unreadable: other checks say why)."""
    try:
        cfg = json.loads((hf_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    q = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    return q if isinstance(q, dict) and q else None


def check_unquantized(flag: str, hf_dir: Path) -> None:
    q = quantization(hf_dir)
    if q is None:
        return
    method = q.get("quant_method", "?")
    detail = ", ".join(f"{k} {q[k]}" for k in ("fmt", "bits", "format") if k in q)
    raise ConfigError(
        f"{flag} {hf_dir}: a quantized checkpoint (config.json quantization_config: quant_method {method!r}"
        f"{', ' + detail if detail else ''}); rlslurm's trainer loads plain bf16/fp32 weights and its weight "
        f"sync sends them unquantized, so pass the unquantized checkpoint the quantized one was made from ({DOC})")
