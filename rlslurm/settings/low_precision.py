"""Low precision, never silently dropped (the facts: docs/low-precision.md).

Training: megatron-core's FP8/FP4 paths run inside transformer-engine's layers, and rlslurm's
stacks have no transformer-engine (it does not build on CPU, docs/megatron-cpu.md, and the GPU
image does not install it), so rlslurm trains in bf16/fp32 only. slime's precision flags and the
matching `--megatron-*` fields are refused with that reason instead of passing through to a trainer
that would ignore them or fail inside megatron.

Checkpoints: a `--hf-checkpoint` whose config.json has a `quantization_config` holds quantized
weights plus their scales. Two layouts are taken; the trainer dequantizes them on load and trains in
bf16/fp32, the engines serve the checkpoint as it is (SGLang reads the same quantization_config), and
every weight sync quantizes the trained weights back to that layout:
- block-wise FP8 as Qwen's *-FP8 releases store it (quant_method fp8, e4m3, dynamic activation
  scales, 128x128 weight blocks): convert/fp8.py, `WeightSyncPlan.fp8_block`;
- INT4 W4A16 compressed-tensors as slime's INT4 recipes serve it (pack-quantized, symmetric int4
  groups, routed experts only, since SGLang can reload only its MoE INT4 layers after a weight
  update and only with its weight-update session, 0.5.23): convert/int4.py, `WeightSyncPlan.int4_group`.
Any other quantization (other compressed-tensors schemes, per-tensor FP8, other block sizes, static
activation scales) is refused at submit, naming what it is.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from rlslurm.errors import ConfigError
from rlslurm.settings.argv import flag_value

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


def _config(hf_dir: Path) -> dict | None:
    """config.json (None when absent or unreadable: other checks say why)."""
    try:
        cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def quantization(hf_dir: Path, cfg: dict | None = None) -> dict | None:
    """config.json's `quantization_config` (`cfg`: config.json, when the caller has read it)."""
    cfg = _config(hf_dir) if cfg is None else cfg
    q = cfg.get("quantization_config") if cfg is not None else None
    return q if isinstance(q, dict) and q else None


# Qwen's *-FP8 releases, and the only FP8 layout rlslurm quantizes to (convert/fp8.py)
FP8_BLOCK = (128, 128)
WHY_QUANTIZED = ("rlslurm's trainer dequantizes and its weight sync re-quantizes only block-wise FP8 (quant_method "
                 f"fp8, fmt e4m3, activation_scheme dynamic, weight_block_size [128, 128]) and INT4 W4A16 "
                 f"compressed-tensors (pack-quantized, symmetric int4 groups); pass one of those, or the "
                 f"unquantized checkpoint this one was made from ({DOC})")


def fp8_block(hf_dir: Path | None, flag: str = "--hf-checkpoint", cfg: dict | None = None) -> tuple[int, int] | None:
    """The weight block of a block-wise FP8 checkpoint, None for an unquantized one (or no readable
    config.json: other checks say why); ConfigError naming the layout for any other quantization.
    `cfg`: config.json, when the caller has read it (`stored_precision`)."""
    q = quantization(hf_dir, cfg) if hf_dir is not None else None
    if q is None:
        return None
    method = q.get("quant_method", "?")
    if method == "compressed-tensors":
        int4_scheme(hf_dir, flag, cfg)  # taken as INT4 W4A16, or refused naming the field
        return None
    what = ", ".join(f"{k} {q[k]}" for k in ("fmt", "bits", "format", "activation_scheme", "weight_block_size")
                     if k in q)
    lead = f"{flag} {hf_dir}: config.json quantization_config (quant_method {method!r}{', ' + what if what else ''})"
    if method != "fp8":
        raise ConfigError(f"{lead} is neither block-wise FP8 nor INT4 W4A16; {WHY_QUANTIZED}")
    # SGLang and slime read fp8 weights as float8_e4m3fn; MiniMax-M2's releases spell the format so
    if q.get("fmt", "e4m3") not in ("e4m3", "float8_e4m3fn"):
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
    block-wise FP8 or INT4 W4A16, ConfigError with the reason for anything else."""
    if (stored := stored_precision(hf_dir, flag)).fp8_block is None:
        scheme = stored.int4
        if scheme is None:
            return None
        check_int4_tensors(hf_dir, flag, checkpoint_names(hf_dir))
        if flag == "--hf-checkpoint":
            return (f"{flag} {hf_dir}: INT4 W4A16 compressed-tensors (group size {scheme.group_size}): the trainer "
                    f"dequantizes it and trains in bf16 (fp32 without --bf16), slime's INT4 fake-QAT is not done; "
                    f"the engines serve INT4 (Marlin MoE) and need SGLang 0.5.23's weight-update session; each "
                    f"weight sync quantizes the trained experts back to INT4 groups ({DOC})")
        return f"{flag} {hf_dir}: INT4 W4A16: dequantized on load, the reference model runs in bf16/fp32 ({DOC})"
    if flag == "--hf-checkpoint":
        return (f"{flag} {hf_dir}: block-wise FP8 (e4m3, 128x128 blocks): the trainer dequantizes it and trains in "
                f"bf16 (fp32 without --bf16); the engines serve FP8, and each weight sync quantizes the trained "
                f"weights back to FP8 blocks ({DOC})")
    return f"{flag} {hf_dir}: block-wise FP8: dequantized on load, the reference model runs in bf16/fp32 ({DOC})"


def check_engine_quantization(sglang_args: list[str] | tuple[str, ...], fp8: bool) -> None:
    """`--sglang-quantization X` beside an FP8 --hf-checkpoint: only fp8 matches what the weight sync
    sends (FP8 weights and their block scales, in the checkpoint's names)."""
    value = flag_value(sglang_args, "--quantization")  # the one SGLang will use: argparse keeps the last
    if fp8 and value is not None and value != "fp8":
        raise ConfigError(f"--sglang-quantization {value}: --hf-checkpoint is block-wise FP8, and the weight "
                              f"sync sends FP8 weights with their block scales; drop the flag or pass fp8 ({DOC})")


# ----------------------------------------------------------------------------- INT4 W4A16 (slime's INT4)
# The one compressed-tensors scheme rlslurm takes (docs/low-precision.md, "INT4 W4A16 checkpoints"): what
# llm-compressor's W4A16 preset writes and slime's INT4 recipes serve. Each field is the value SGLang's
# CompressedTensorsWNA16MoE needs for its Marlin path (symmetric: no zero points; no activation order:
# no g_idx) and that convert/int4.py packs bit for bit as compressed-tensors' pack-quantized format does.
INT4_WEIGHTS = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "dynamic": False}
WHY_INT4 = ("rlslurm takes compressed-tensors only as INT4 W4A16: format pack-quantized, one config group, weights "
            "num_bits 4, type int, symmetric, strategy group, static, no activation order, activations unquantized; "
            "pass that, a block-wise FP8 checkpoint, or the unquantized checkpoint this one was made from "
            f"({DOC})")
# the routed experts' projections in the HF names of the MoE families slime's INT4 scripts train
# (Qwen3-MoE, DeepSeek-V3: Moonlight, Kimi-K2): SGLang serves them through its FusedMoE layer
EXPERT = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.$")
PACKED, SCALE, SHAPE = "weight_packed", "weight_scale", "weight_shape"


@dataclass(frozen=True)
class Int4Scheme:
    group_size: int
    ignore: tuple[str, ...] = ()   # the checkpoint's `ignore` list, for the record: the tensors say what is INT4


def int4_scheme(hf_dir: Path | None, flag: str = "--hf-checkpoint", cfg: dict | None = None) -> Int4Scheme | None:
    """The scheme of an INT4 W4A16 compressed-tensors checkpoint; None for any other (or none, or no
    readable config.json); ConfigError naming the field for a compressed-tensors config of another scheme.
    `cfg`: config.json, when the caller has read it (`stored_precision`)."""
    if cfg is None:
        cfg = _config(hf_dir) if hf_dir is not None else None
    q = quantization(hf_dir, cfg) if cfg is not None else None
    if q is None or q.get("quant_method") != "compressed-tensors":
        return None
    lead = f"{flag} {hf_dir}: config.json quantization_config (quant_method 'compressed-tensors')"

    def refuse(field: str, value) -> ConfigError:
        return ConfigError(f"{lead}: {field} {value!r}; {WHY_INT4}")

    groups = q.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise refuse("config_groups", sorted(groups) if isinstance(groups, dict) else groups)
    (gname, g), = groups.items()
    if not isinstance(g, dict):
        raise refuse(f"config_groups.{gname}", g)
    fmt = g.get("format") or q.get("format")
    if fmt != "pack-quantized":
        raise refuse("format", fmt)
    w = g.get("weights")
    if not isinstance(w, dict):
        raise refuse(f"config_groups.{gname}.weights", w)
    for key, want in INT4_WEIGHTS.items():
        have = w.get(key, False if key == "dynamic" else None)
        if have != want:
            raise refuse(f"config_groups.{gname}.weights.{key}", have)
    if w.get("actorder") not in (None, "static"):  # "group" would need SGLang's g_idx reordering
        raise refuse(f"config_groups.{gname}.weights.actorder", w.get("actorder"))
    for key in ("block_structure", "scale_dtype", "zp_dtype"):
        if w.get(key) is not None:
            raise refuse(f"config_groups.{gname}.weights.{key}", w[key])
    gs = w.get("group_size")
    if not isinstance(gs, int) or isinstance(gs, bool) or gs <= 0:
        raise refuse(f"config_groups.{gname}.weights.group_size", gs)
    for key in ("input_activations", "output_activations"):
        if g.get(key) is not None:
            raise refuse(f"config_groups.{gname}.{key}", g[key])
    for key in ("kv_cache_scheme", "transform_config"):
        if q.get(key):
            raise refuse(key, q[key])
    if q.get("sparsity_config") and q["sparsity_config"].get("format", "dense") != "dense":
        raise refuse("sparsity_config.format", q["sparsity_config"].get("format"))
    if q.get("quantization_status", "compressed") != "compressed":
        raise refuse("quantization_status", q.get("quantization_status"))
    # the routed experts' input dims (gate/up: hidden_size, down: moe_intermediate_size) come in whole
    # groups: SGLang's Marlin MoE sizes its scales as dim // group_size (compressed_tensors_wNa16_moe.py)
    for key in ("hidden_size", "moe_intermediate_size"):
        dim = cfg.get(key)
        if isinstance(dim, int) and dim % gs:
            raise ConfigError(f"{lead}: group_size {gs} does not divide {key} {dim}, an input dim of the INT4 "
                              f"experts; {WHY_INT4}")
    return Int4Scheme(gs, tuple(q.get("ignore") or ()))


@dataclass(frozen=True)
class StoredPrecision:
    """What a checkpoint stores quantized: block-wise FP8 (`fp8_block`), INT4 W4A16 (`int4`), or neither
    (`stored_precision`; at submit once, resolve.py `Resolved.stored`)."""
    fp8_block: tuple[int, int] | None = None
    int4: Int4Scheme | None = None

    @property
    def quantized(self) -> bool:
        return self.fp8_block is not None or self.int4 is not None


def stored_precision(hf_dir: Path | None, flag: str = "--hf-checkpoint") -> StoredPrecision:
    """Its config.json read once; ConfigError, naming the field, for a quantization rlslurm does not take
    (`fp8_block`, `int4_scheme`)."""
    cfg = _config(hf_dir) if hf_dir is not None else None
    return StoredPrecision(fp8_block(hf_dir, flag, cfg), int4_scheme(hf_dir, flag, cfg))


def checkpoint_names(hf_dir: Path) -> list[str] | None:
    """The tensor names of a safetensors checkpoint, off its index or its files' headers, without
    reading a tensor (rlslurm/safetensors_names.py); None when there are none to read (an empty
    placeholder file)."""
    from rlslurm.errors import DataError
    from rlslurm.safetensors_names import checkpoint_names as names_of

    try:
        return names_of(hf_dir) or None
    except DataError:
        return None


def check_int4_tensors(hf_dir: Path, flag: str, names: list[str] | None) -> list[str]:
    """The HF bases (`...down_proj.`) the checkpoint stores in INT4: only routed experts, each with its
    scale and shape. Any other INT4 layer is refused: SGLang's linear W4A16 layer (CompressedTensorsWNA16)
    replaces its parameters by Marlin-packed ones after loading and has no way back, so a weight update
    cannot load it (docs/low-precision.md). `names` None (nothing readable): nothing to check here."""
    if names is None:
        return []
    have = set(names)
    bases = sorted(n[: -len(PACKED)] for n in names if n.endswith("." + PACKED))
    lead = f"{flag} {hf_dir}: INT4 W4A16 compressed-tensors"
    if not bases:
        raise ConfigError(f"{lead}: no tensor is *.{PACKED}, so nothing in it is INT4 ({DOC})")
    for b in bases:
        missing = [b + s for s in (SCALE, SHAPE) if b + s not in have]
        if missing:
            raise ConfigError(f"{lead}: {b}{PACKED} has no {missing[0]} beside it ({DOC})")
    linear = [b for b in bases if not EXPERT.search(b)]
    if linear:
        raise ConfigError(f"{lead}: {linear[0]}{PACKED} ({len(linear)} such) is an INT4 layer outside the routed "
                          f"experts; SGLang cannot load a weight update into its INT4 linear layers (they are "
                          f"repacked for Marlin with no way back), so only routed experts may be INT4: quantize "
                          f"with the other layers ignored (as slime's tools/convert_hf_to_int4.py does), or pass "
                          f"the unquantized checkpoint ({DOC})")
    return bases


def check_int4_engine(hf_dir: str | Path, weight_update_session: bool, version: str) -> None:
    """At an engine's start: an INT4 checkpoint needs SGLang's weight-update session, whose begin
    restores the MoE INT4 parameters to the checkpoint's layout and whose end repacks them for Marlin.
    0.5.14 has neither: its update loads into the repacked parameters and never repacks (docs/low-precision.md)."""
    if weight_update_session or int4_scheme(Path(hf_dir), "model") is None:
        return
    raise ConfigError(f"{hf_dir}: INT4 W4A16 compressed-tensors, and SGLang {version} cannot load a weight update "
                      f"into INT4 layers (no /begin_weight_update to undo the Marlin repack, no repack after); "
                      f"install SGLang 0.5.23 (no supported GPU stack has it yet: --allow-untested-stack, "
                      f"docs/supported-stacks.md), or serve the unquantized or a block-wise FP8 checkpoint ({DOC})")


def check_int4_engine_args(sglang_args: list[str] | tuple[str, ...], device: str) -> None:
    """Engine flags beside an INT4 --hf-checkpoint: SGLang's INT4 MoE is reloadable only in its Marlin
    form (the Triton one, `--moe-runner-backend triton` or Blackwell's auto, keeps no way back), and
    its kernels are CUDA's."""
    if device != "cuda":
        raise ConfigError(f"--hf-checkpoint is INT4 W4A16: SGLang serves it with CUDA Marlin kernels, and the "
                          f"rollout device is {device}; use the unquantized checkpoint on CPU ({DOC})")
    quant, moe = flag_value(sglang_args, "--quantization"), flag_value(sglang_args, "--moe-runner-backend")
    if quant is not None and quant != "compressed-tensors":
        raise ConfigError(f"--sglang-quantization {quant}: --hf-checkpoint is INT4 W4A16 compressed-tensors and "
                          f"the weight sync sends INT4 groups; drop the flag or pass compressed-tensors ({DOC})")
    if moe is not None and moe != "marlin":
        raise ConfigError(f"--sglang-moe-runner-backend {moe}: --hf-checkpoint is INT4 W4A16, and SGLang can "
                          f"reload INT4 experts only in their Marlin form; drop the flag or pass marlin ({DOC})")
