"""A tiny block-wise FP8 Qwen3 checkpoint for CPU tests, made as Qwen's *-FP8 releases are: a bf16
checkpoint whose linear weights are quantized to float8_e4m3fn in 128x128 blocks, each with a
float32 `<name>_scale_inv` (one per block), and config.json's quantization_config saying so.

The model is tiny-qwen3 made wide enough for whole 128x128 blocks (transformers' Fp8Dequantize,
the reference of tests/convert/test_fp8_load.py, takes only shapes the blocks divide). The
quantizer here is written block by block, independently of rlslurm/convert/fp8.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
# tiny-qwen3, widened: q/o [256, 256], k/v [128, 256], gate/up [384, 256], down [256, 384]
MODEL_YAML = """\
name: tiny-qwen3-fp8
hf_architecture: Qwen3ForCausalLM
hf_model_type: qwen3
tiny: true
arch:
  num_layers: 2
  hidden_size: 256
  ffn_hidden_size: 384
  num_attention_heads: 4
  num_query_groups: 2
  kv_channels: 64
  vocab_size: 64
  max_position_embeddings: 256
  norm_epsilon: 1.0e-6
  rotary_base: 10000
  qk_layernorm: true
  tie_word_embeddings: false
defaults:
  2: {trainer_nodes: 1, rollout_nodes: 1, device: cpu, gpus_per_node: 0, trainer_procs_per_node: 2,
      rollout_num_gpus_per_engine: 1, engines_per_node: 2, rollout_batch_size: 8, n_samples_per_prompt: 4,
      global_batch_size: 16, num_steps_per_rollout: 2, micro_batch_size: 4, rollout_max_response_len: 8,
      lr: 3.0e-3, bf16: true}
"""


def model_yaml(root: Path) -> Path:
    p = root / "tiny-qwen3-fp8.yaml"
    p.write_text(MODEL_YAML)
    return p


def is_quantized(name: str) -> bool:
    """The linear weights Qwen3-*-FP8 stores in FP8 (norms, embedding and lm_head stay bf16)."""
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


def block_quantize(w: torch.Tensor, bn: int = 128, bk: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    w = w.to(torch.float32)
    n, k = w.shape
    rows, cols = -(-n // bn), -(-k // bk)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    s = torch.empty(rows, cols, dtype=torch.float32)
    for i in range(rows):
        for j in range(cols):
            blk = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            s[i, j] = blk.abs().max().clamp(min=1e-12) / 448.0
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (blk / s[i, j]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, s


def make_fp8_checkpoint(root: Path) -> tuple[Path, Path, Path]:
    """(model YAML, bf16 checkpoint, its FP8 version) under `root`."""
    from safetensors.torch import load_file, save_file

    from rlslurm.settings.model_config import load_model_config
    from rlslurm.tiny import make_tiny_checkpoint

    yaml = model_yaml(root)
    bf16 = make_tiny_checkpoint(load_model_config(str(yaml)), root / "bf16", dtype="bfloat16")
    fp8 = root / "fp8"
    fp8.mkdir()
    out: dict[str, torch.Tensor] = {}
    for name, t in load_file(str(bf16 / "model.safetensors")).items():
        if is_quantized(name):
            out[name], out[name + "_scale_inv"] = block_quantize(t)
        else:
            out[name] = t
    save_file(out, str(fp8 / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((bf16 / "config.json").read_text())
    cfg["quantization_config"] = dict(QUANT)
    (fp8 / "config.json").write_text(json.dumps(cfg))
    for aux in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(bf16 / aux, fp8 / aux)
    return yaml, bf16, fp8
