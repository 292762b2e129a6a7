"""A tiny INT4 W4A16 compressed-tensors Qwen3-MoE checkpoint for CPU tests, made as slime's INT4
recipes make theirs (tools/convert_hf_to_int4.py: llm-compressor's W4A16 preset with attention, the
router gate, norms, embeddings and lm_head ignored): a bf16 checkpoint whose routed experts'
projections are quantized symmetric int4 per group and packed by compressed-tensors itself
(calculate_qparams, quantize, pack_to_int32 of compressed_tensors 0.18.0, the reference of the format;
rlslurm's own packer, rlslurm/convert/int4.py, is what the tests check against it)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

GROUP = 32  # divides tiny-qwen3-moe's hidden_size 64 and moe_ffn_hidden_size 32
IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*mlp\\.gate$"]
QUANT = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP,
                    "dynamic": False, "actorder": None, "observer": "minmax"}}},
    "ignore": IGNORE,
}
EXPERT = re.compile(r"\.experts\.\d+\.(gate|up|down)_proj\.weight$")
# for GPUs: tiny-qwen3-moe widened so SGLang's Marlin MoE takes its experts (its repack tiles the input
# dim by 64 and the output dim by 64: w13 [2 x 128, 256], w2 [256, 128]), in groups of 128 as slime's
MODEL_YAML = """\
name: tiny-qwen3-moe-int4
hf_architecture: Qwen3MoeForCausalLM
hf_model_type: qwen3_moe
tiny: true
arch:
  num_layers: 2
  hidden_size: 256
  ffn_hidden_size: 512
  num_attention_heads: 4
  num_query_groups: 2
  kv_channels: 64
  vocab_size: 64
  max_position_embeddings: 256
  norm_epsilon: 1.0e-6
  rotary_base: 10000
  qk_layernorm: true
  tie_word_embeddings: false
  moe:
    num_experts: 4
    router_topk: 2
    moe_ffn_hidden_size: 128
    router_score_function: softmax
    router_topk_norm: true
defaults:
  2: {trainer_nodes: 1, rollout_nodes: 1, device: cpu, gpus_per_node: 0, trainer_procs_per_node: 2,
      rollout_num_gpus_per_engine: 1, engines_per_node: 2, rollout_batch_size: 8, n_samples_per_prompt: 4,
      global_batch_size: 16, num_steps_per_rollout: 2, micro_batch_size: 4, rollout_max_response_len: 8,
      lr: 3.0e-3, bf16: true}
"""


def model_yaml(root: Path) -> Path:
    p = root / "tiny-qwen3-moe-int4.yaml"
    p.write_text(MODEL_YAML)
    return p


def ct_quantize(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' own (weight_packed, weight_scale) of `w`, min-max observed per group."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)
    g = w.reshape(w.shape[0], -1, group)
    scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), args)
    return pack_to_int32(quantize(w, scale, zp, args, dtype=torch.int8), 4), scale


def ct_dequantize(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' own decompression (unpack_from_int32, dequantize) to the scale's dtype."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    return dequantize(unpack_from_int32(packed, 4, torch.Size(shape.tolist())), scale, None)


def make_int4_checkpoint(root: Path, model: str = "tiny-qwen3-moe", group: int = GROUP) -> tuple[Path, Path]:
    """(bf16 checkpoint, its INT4 W4A16 version in groups of `group`) under `root`; `model`: a model
    config name or YAML."""
    from safetensors.torch import load_file, save_file

    from rlslurm.settings.model_config import load_model_config
    from rlslurm.tiny import make_tiny_checkpoint

    bf16 = make_tiny_checkpoint(load_model_config(model), root / "bf16", dtype="bfloat16")
    int4 = root / "int4"
    int4.mkdir()
    out: dict[str, torch.Tensor] = {}
    for name, t in load_file(str(bf16 / "model.safetensors")).items():
        if EXPERT.search(name):
            base = name[: -len("weight")]
            out[base + "weight_packed"], out[base + "weight_scale"] = ct_quantize(t, group)
            out[base + "weight_shape"] = torch.tensor(t.shape)  # as the compressor writes it: int64
        else:
            out[name] = t
    save_file(out, str(int4 / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((bf16 / "config.json").read_text())
    cfg["quantization_config"] = json.loads(json.dumps(QUANT))
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = group
    (int4 / "config.json").write_text(json.dumps(cfg))
    for aux in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(bf16 / aux, int4 / aux)
    return bf16, int4
