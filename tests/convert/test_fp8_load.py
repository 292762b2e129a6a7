"""A block-wise FP8 --hf-checkpoint through megatron-core on CPU (TP 2, gloo; issue 32 item 6):

- the trainer's load dequantizes every FP8 weight with its scale_inv blocks, equal to transformers'
  own Fp8Dequantize of the same tensors (bf16 parameters: one rounding of the fp32 product);
  the `_scale_inv` tensors are consumed, never loaded as weights;
- a weight sync sends the checkpoint's own layout: the same names, dtypes and shapes (FP8 weights,
  fp32 scale blocks, bf16 rest), and its FP8 blocks give back the trained weights within e4m3's
  rounding;
- the disk publisher (the fallback) writes a valid FP8 HF checkpoint of that layout, config.json's
  quantization_config kept; --save-hf writes plain bf16 without it.

What the engines make of it needs a GPU (docs/low-precision.md): CPU SGLang has no FP8 GEMM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from convert_helpers import check, dtype_runs, run_procs  # noqa: F401 (check, run_procs: conftest's two_rank_runs)

from tests.helpers.fp8_ckpt import QUANT, make_fp8_checkpoint

pytestmark = [pytest.mark.megatron]


def two_rank_run(request: pytest.FixtureRequest, out: Path) -> list[str]:
    yaml, _, fp8 = make_fp8_checkpoint(out)
    return ["tests/convert/quantized_worker.py", "--model", str(yaml), "--fp8-dir", str(fp8), "--out", str(out / "run")]


@pytest.fixture(scope="module")
def run(two_rank_runs) -> Path:
    return two_rank_runs[__name__]


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _reference_dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """transformers' own block dequantization (integrations/finegrained_fp8.py Fp8Dequantize), the
    op its FP8 loader runs on CPU; called directly, as a full from_pretrained needs accelerate."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(None)._dequantize_one(q, s, torch.bfloat16)


def test_load_dequantizes_like_transformers(run: Path) -> None:
    ckpt = _tensors(run / "fp8" / "model.safetensors")
    loaded = _tensors(run / "run" / "loaded.safetensors")
    scales = {n for n in ckpt if n.endswith("_scale_inv")}
    assert scales and not scales & set(loaded)  # consumed, never mapped
    assert set(loaded) == set(ckpt) - scales
    assert json.loads((run / "run" / "summary.json").read_text())["tp"] == 2
    for name, t in loaded.items():
        assert t.dtype == torch.bfloat16, name
        if name + "_scale_inv" in ckpt:
            assert ckpt[name].dtype == torch.float8_e4m3fn
            assert torch.equal(t, _reference_dequant(ckpt[name], ckpt[name + "_scale_inv"])), name
        else:
            assert torch.equal(t, ckpt[name]), name


def _within_e4m3(w: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block=(128, 128)) -> bool:
    """|w - q*s| <= |w| 2^-4 + s 2^-10 per element: e4m3 keeps 3 mantissa bits (half an ulp is 2^-4 of
    a normal value) and its subnormal step is 2^-9 of the block's scale."""
    s_full = s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: w.shape[0], : w.shape[1]]
    w = w.to(torch.float32)
    err = (w - q.to(torch.float32) * s_full).abs()
    return bool((err <= w.abs() * 2**-4 + s_full * 2**-10 + 1e-12).all())


def test_sync_sends_the_checkpoints_layout(run: Path) -> None:
    ckpt = _tensors(run / "fp8" / "model.safetensors")
    sync = _tensors(run / "run" / "sync.safetensors")
    loaded = _tensors(run / "run" / "loaded.safetensors")
    layout = lambda d: {n: (t.dtype, tuple(t.shape)) for n, t in d.items()}  # noqa: E731
    assert layout(sync) == layout(ckpt)
    for name, t in sync.items():
        if t.dtype == torch.float8_e4m3fn:
            assert _within_e4m3(loaded[name], t, sync[name + "_scale_inv"]), name
            assert not torch.isnan(t.to(torch.float32)).any(), name
        elif not name.endswith("_scale_inv"):
            assert torch.equal(t, loaded[name]), name
    runs = dtype_runs(run / "run", sync)  # one run per dtype after the big tensors
    assert len(runs) <= 4, runs


def test_disk_fallback_writes_an_fp8_checkpoint(run: Path) -> None:
    ckpt = _tensors(run / "fp8" / "model.safetensors")
    disk = _tensors(run / "run" / "disk" / "model.safetensors")
    sync = _tensors(run / "run" / "sync.safetensors")
    assert {n: (t.dtype, tuple(t.shape)) for n, t in disk.items()} == {
        n: (t.dtype, tuple(t.shape)) for n, t in ckpt.items()}
    assert all(torch.equal(disk[n].view(torch.uint8) if disk[n].dtype == torch.float8_e4m3fn else disk[n],
                           sync[n].view(torch.uint8) if sync[n].dtype == torch.float8_e4m3fn else sync[n])
               for n in disk)  # the same bytes as the sync sends
    cfg = json.loads((run / "run" / "disk" / "config.json").read_text())
    assert cfg["quantization_config"] == QUANT
    # the directory loads again as an FP8 checkpoint (rlslurm's reader; SGLang's needs a GPU)
    from rlslurm.convert.fp8 import dequantizing
    from rlslurm.convert.hf_io import HFCheckpoint

    get = dequantizing(HFCheckpoint(run / "run" / "disk"), (128, 128))
    name = "model.layers.1.mlp.down_proj.weight"
    assert get(name).dtype == torch.float32 and get(name).shape == ckpt[name].shape


def test_save_hf_writes_plain_bf16_without_quantization_config(run: Path) -> None:
    plain = _tensors(run / "run" / "plain" / "model.safetensors")
    loaded = _tensors(run / "run" / "loaded.safetensors")
    assert set(plain) == set(loaded) and all(torch.equal(plain[n], loaded[n]) for n in plain)
    assert "quantization_config" not in json.loads((run / "run" / "plain" / "config.json").read_text())
