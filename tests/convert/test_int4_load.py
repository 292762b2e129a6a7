"""An INT4 W4A16 compressed-tensors --hf-checkpoint (slime's INT4 recipes) through megatron-core on CPU
(TP 2, gloo; issue 32 item 6):

- the trainer's load unpacks and scales every INT4 expert weight, equal bit for bit to
  compressed-tensors' own decompression of the same tensors (bf16); weight_scale and weight_shape
  are consumed, never loaded as weights;
- a weight sync sends the checkpoint's own layout (the same names, dtypes and shapes: int32 words,
  bf16 group scales, int64 shapes, bf16 rest: attention and the router gate, which the checkpoint's
  `ignore` list kept bf16), its words and scales bit for bit compressed-tensors' quantize + pack of
  the trained weights;
- the disk publisher (the fallback) writes a valid INT4 HF checkpoint of that layout, config.json's
  quantization_config kept; --save-hf writes plain bf16 without it.

What the engines make of it needs a GPU (docs/low-precision.md; tests/gpu/test_int4_checkpoint.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from convert_helpers import check, dtype_runs, run_procs  # noqa: F401 (check, run_procs: conftest's two_rank_runs)

pytest.importorskip("compressed_tensors")  # the format's reference, never imported by rlslurm
from tests.helpers.int4_ckpt import EXPERT, GROUP, QUANT, ct_dequantize, ct_quantize, make_int4_checkpoint  # noqa: E402

pytestmark = [pytest.mark.megatron]


def two_rank_run(request: pytest.FixtureRequest, out: Path) -> list[str]:
    _, int4 = make_int4_checkpoint(out)
    return ["tests/convert/quantized_worker.py", "--model", "tiny-qwen3-moe", "--int4-dir", str(int4),
            "--group", str(GROUP), "--out", str(out / "run")]


@pytest.fixture(scope="module")
def run(two_rank_runs) -> Path:
    return two_rank_runs[__name__]


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def test_load_dequantizes_like_compressed_tensors(run: Path) -> None:
    ckpt = _tensors(run / "int4" / "model.safetensors")
    loaded = _tensors(run / "run" / "loaded.safetensors")
    parts = {n for n in ckpt if n.endswith(("weight_packed", "weight_scale", "weight_shape"))}
    assert parts and not parts & set(loaded)  # consumed, never mapped
    bases = {n[: -len("_packed")] for n in ckpt if n.endswith("weight_packed")}
    assert set(loaded) == (set(ckpt) - parts) | bases
    assert json.loads((run / "run" / "summary.json").read_text())["tp"] == 2
    for name, t in loaded.items():
        assert t.dtype == torch.bfloat16, name
        if name in bases:
            b = name[: -len("weight")]
            ref = ct_dequantize(ckpt[b + "weight_packed"], ckpt[b + "weight_scale"], ckpt[b + "weight_shape"])
            assert torch.equal(t, ref), name
        else:
            assert torch.equal(t, ckpt[name]), name


def test_sync_sends_the_checkpoints_layout_as_compressed_tensors_packs_it(run: Path) -> None:
    ckpt = _tensors(run / "int4" / "model.safetensors")
    sync = _tensors(run / "run" / "sync.safetensors")
    loaded = _tensors(run / "run" / "loaded.safetensors")
    layout = lambda d: {n: (t.dtype, tuple(t.shape)) for n, t in d.items()}  # noqa: E731
    assert layout(sync) == layout(ckpt)
    n_int4 = 0
    for name, w in loaded.items():
        if EXPERT.search(name):
            b = name[: -len("weight")]
            packed, scale = ct_quantize(w)
            assert torch.equal(sync[b + "weight_packed"], packed), name
            assert torch.equal(sync[b + "weight_scale"], scale), name
            assert sync[b + "weight_shape"].tolist() == list(w.shape), name
            n_int4 += 1
        else:  # attention, the router gate, norms, embeddings: the ignore list's bf16
            assert torch.equal(sync[name], w), name
    assert n_int4 == 2 * 4 * 3  # layers x experts x (gate, up, down)
    assert any(".self_attn." in n for n in sync) and "model.layers.0.mlp.gate.weight" in sync
    runs = dtype_runs(run / "run", sync)  # one run per dtype after the big tensors
    assert len(runs) <= 5, runs


def test_disk_fallback_writes_an_int4_checkpoint(run: Path) -> None:
    ckpt = _tensors(run / "int4" / "model.safetensors")
    disk = _tensors(run / "run" / "disk" / "model.safetensors")
    sync = _tensors(run / "run" / "sync.safetensors")
    assert {n: (t.dtype, tuple(t.shape)) for n, t in disk.items()} == {
        n: (t.dtype, tuple(t.shape)) for n, t in ckpt.items()}
    assert all(torch.equal(disk[n], sync[n]) for n in disk)  # the same bytes as the sync sends
    cfg = json.loads((run / "run" / "disk" / "config.json").read_text())
    assert cfg["quantization_config"] == QUANT


def test_save_hf_writes_plain_bf16_without_quantization_config(run: Path) -> None:
    plain = _tensors(run / "run" / "plain" / "model.safetensors")
    loaded = _tensors(run / "run" / "loaded.safetensors")
    assert set(plain) == set(loaded) and all(torch.equal(plain[n], loaded[n]) for n in plain)
    assert "quantization_config" not in json.loads((run / "run" / "plain" / "config.json").read_text())
