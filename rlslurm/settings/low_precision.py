"""Low precision, never silently dropped (issue 32 item 6; the facts: docs/low-precision.md).

Training: megatron-core's FP8/FP4 paths run inside transformer-engine's layers, and rlslurm's
stacks have no transformer-engine (it does not build on CPU, docs/megatron-cpu.md, and the GPU
image does not install it), so rlslurm trains in bf16/fp32 only. slime's precision flags and the
matching `--megatron-*` fields are refused with that reason instead of passing through to a trainer
that would ignore them or fail inside megatron.

Checkpoints: a `--hf-checkpoint` whose config.json has a `quantization_config` holds quantized
weights plus their scales. Block-wise FP8 as Qwen's *-FP8 releases store it (quant_method fp8, e4m3,
dynamic activation scales, 128x128 weight blocks) is taken: the trainer dequantizes it on load
(convert/fp8.py) and trains in bf16/fp32, the engines serve it as FP8 (SGLang reads the same
quantization_config), and every weight sync quantizes the trained weights back to that layout
(`WeightSyncPlan.fp8_block`). Any other quantization (slime's compressed-tensors INT4, per-tensor
FP8, other block sizes, static activation scales) is refused at submit, naming what it is.
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


# Qwen's *-FP8 releases, and the only FP8 layout rlslurm quantizes to (convert/fp8.py)
FP8_BLOCK = (128, 128)
WHY_QUANTIZED = ("rlslurm's trainer dequantizes and its weight sync re-quantizes only block-wise FP8 (quant_method "
                 f"fp8, fmt e4m3, activation_scheme dynamic, weight_block_size [128, 128]); pass that, or the "
                 f"unquantized checkpoint this one was made from ({DOC})")


def fp8_block(hf_dir: Path | None, flag: str = "--hf-checkpoint") -> tuple[int, int] | None:
    """The weight block of a block-wise FP8 checkpoint, None for an unquantized one (or no readable
    config.json: other checks say why); ConfigError naming the layout for any other quantization."""
    q = quantization(hf_dir) if hf_dir is not None else None
    if q is None:
        return None
    method = q.get("quant_method", "?")
    what = ", ".join(f"{k} {q[k]}" for k in ("fmt", "bits", "format", "activation_scheme", "weight_block_size")
                     if k in q)
    lead = f"{flag} {hf_dir}: config.json quantization_config (quant_method {method!r}{', ' + what if what else ''})"
    if method != "fp8":
        raise ConfigError(f"{lead} is not block-wise FP8; {WHY_QUANTIZED}")
    if q.get("fmt", "e4m3") != "e4m3":  # SGLang and slime read fp8 weights as float8_e4m3fn
        raise ConfigError(f"{lead}: FP8 format {q['fmt']!r}; {WHY_QUANTIZED}")
    if q.get("activation_scheme") != "dynamic":  # SGLang's block-wise FP8 needs dynamic activation scales
        raise ConfigError(f"{lead}: activation_scheme {q.get('activation_scheme')!r}, not 'dynamic'; {WHY_QUANTIZED}")
    block = q.get("weight_block_size")
    if block is None:
        raise ConfigError(f"{lead}: per-tensor FP8 (no weight_block_size); {WHY_QUANTIZED}")
    if list(block) != list(FP8_BLOCK):
        raise ConfigError(f"{lead}: weight_block_size {block}; {WHY_QUANTIZED}")
    return FP8_BLOCK


def checkpoint_precision(flag: str, hf_dir: Path) -> str | None:
    """Submit's check of a checkpoint's quantization: None for a plain one, a one-line note for
    block-wise FP8, ConfigError with the reason for anything else."""
    if fp8_block(hf_dir, flag) is None:
        return None
    if flag == "--hf-checkpoint":
        return (f"{flag} {hf_dir}: block-wise FP8 (e4m3, 128x128 blocks): the trainer dequantizes it and trains in "
                f"bf16 (fp32 without --bf16); the engines serve FP8, and each weight sync quantizes the trained "
                f"weights back to FP8 blocks ({DOC})")
    return f"{flag} {hf_dir}: block-wise FP8: dequantized on load, the reference model runs in bf16/fp32 ({DOC})"


def check_engine_quantization(sglang_args: list[str] | tuple[str, ...], fp8: bool) -> None:
    """`--sglang-quantization X` beside an FP8 --hf-checkpoint: only fp8 matches what the weight sync
    sends (FP8 weights and their block scales, in the checkpoint's names)."""
    args = list(sglang_args)
    for i, a in enumerate(args):
        name, _, value = a.partition("=")
        if name != "--quantization":
            continue
        value = value or (args[i + 1] if i + 1 < len(args) else "")
        if fp8 and value != "fp8":
            raise ConfigError(f"--sglang-quantization {value}: --hf-checkpoint is block-wise FP8, and the weight "
                              f"sync sends FP8 weights with their block scales; drop the flag or pass fp8 ({DOC})")
