"""The block math of FP8 checkpoints (rlslurm/convert/fp8.py), without megatron: quantize ->
dequantize within e4m3's rounding per block, dequantization equal to transformers' own, partial
edge blocks and all-zero blocks, and one-line errors naming the tensor and the file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlslurm.convert import fp8
from rlslurm.errors import DataError
from tests.helpers.fp8_ckpt import block_quantize


def _bound_ok(w: torch.Tensor, deq: torch.Tensor, scale: torch.Tensor, block=(128, 128)) -> bool:
    """e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 of a normal value; below the normal range the
    step is 2^-9 of the block's scale (so half of it 2^-10)."""
    s = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: w.shape[0], : w.shape[1]]
    err = (w.float() - deq).abs()
    return bool((err <= w.float().abs() * 2**-4 + s * 2**-10 + 1e-12).all())


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (128, 1), (1, 1000)])
def test_quantize_dequantize_is_within_e4m3s_bound_per_block(shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(0)
    # blocks of very different magnitudes: each block has its own scale
    w = torch.randn(shape, generator=g) * torch.logspace(-4, 2, shape[0]).unsqueeze(1)
    w = w.to(torch.bfloat16)
    q, s = fp8.quantize(w, (128, 128))
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float32 and tuple(s.shape) == fp8.scale_shape(shape, (128, 128))
    deq = fp8.dequantize(q, s, (128, 128))
    assert deq.dtype == torch.float32 and _bound_ok(w, deq, s)
    # each block's largest |w| lands on e4m3's largest value, 448
    assert q.float().abs().amax().item() == 448.0


def test_an_all_zero_block_stays_zero_without_nan() -> None:
    w = torch.zeros(256, 256)
    w[0, 0] = 1.0  # one non-zero block, three all-zero ones
    q, s = fp8.quantize(w, (128, 128))
    deq = fp8.dequantize(q, s, (128, 128))
    assert not torch.isnan(deq).any() and (s > 0).all() and torch.equal(deq, w)


def test_dequantize_equals_transformers_fp8_dequantize() -> None:
    """transformers' FP8 loader multiplies each block out in fp32 (Fp8Dequantize._dequantize_one)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    g = torch.Generator().manual_seed(1)
    q, s = block_quantize(torch.randn(384, 256, generator=g))
    ref = Fp8Dequantize(None)._dequantize_one(q, s, torch.float32)
    assert torch.equal(fp8.dequantize(q, s, (128, 128)), ref)
    assert torch.equal(fp8.dequantize(q, s, (128, 128)).to(torch.bfloat16),
                       Fp8Dequantize(None)._dequantize_one(q, s, torch.bfloat16))


def test_our_quantizer_matches_an_independent_one() -> None:
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(2))
    q, s = fp8.quantize(w, (128, 128))
    q_ref, s_ref = block_quantize(w)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def _ckpt(tmp_path: Path, tensors: dict) -> "object":
    from safetensors.torch import save_file

    from rlslurm.convert.hf_io import HFCheckpoint

    save_file(tensors, str(tmp_path / "model.safetensors"))
    return HFCheckpoint(tmp_path)


def test_the_reader_consumes_scale_inv_and_names_bad_tensors(tmp_path: Path) -> None:
    q, s = block_quantize(torch.randn(128, 256))
    ckpt = _ckpt(tmp_path, {"a.weight": q, "a.weight_scale_inv": s, "b.weight": q.clone(),
                            "c.weight": q.clone(), "c.weight_scale_inv": torch.ones(2, 2), "n.weight": torch.ones(4)})
    get = fp8.dequantizing(ckpt, (128, 128))
    assert torch.equal(get("a.weight"), fp8.dequantize(q, s, (128, 128)))
    assert torch.equal(get("n.weight"), torch.ones(4))
    with pytest.raises(DataError, match=rf"^{tmp_path}: FP8 tensor 'b.weight' has no 'b.weight_scale_inv' beside it"):
        get("b.weight")
    with pytest.raises(DataError, match=r"c.weight_scale_inv has shape \(2, 2\), but c.weight \(128, 256\) in "
                                        r"128x128 blocks needs \(1, 2\)"):
        get("c.weight")
    with pytest.raises(DataError, match=r"'a.weight' is float8_e4m3fn, but config.json has no fp8 quantization_config"):
        fp8.dequantizing(ckpt, None)("a.weight")
    assert fp8.quantized_names(ckpt.names()) == {"a.weight", "c.weight"}


def test_export_quantizes_listed_weights_and_groups_small_tensors_last() -> None:
    exp = fp8.Fp8Export((128, 128), frozenset({"l.0.q.weight", "l.1.q.weight"}))
    big = torch.randn(1024, 1024, dtype=torch.bfloat16)  # 2 MiB: stays in place
    stream = [("emb", big), ("l.0.norm", torch.ones(8, dtype=torch.bfloat16)), ("l.0.q.weight", torch.randn(256, 128)),
              ("l.1.norm", torch.ones(8, dtype=torch.bfloat16)), ("l.1.q.weight", torch.randn(128, 128))]
    out = list(exp.quantize(iter(stream)))
    assert [(n, str(t.dtype).removeprefix("torch.")) for n, t in out] == [
        ("emb", "bfloat16"), ("l.0.q.weight", "float8_e4m3fn"), ("l.1.q.weight", "float8_e4m3fn"),
        ("l.0.norm", "bfloat16"), ("l.1.norm", "bfloat16"),
        ("l.0.q.weight_scale_inv", "float32"), ("l.1.q.weight_scale_inv", "float32")]
    assert tuple(dict(out)["l.0.q.weight_scale_inv"].shape) == (2, 1)
