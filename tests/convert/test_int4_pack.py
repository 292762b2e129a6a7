"""INT4 W4A16 packing (rlslurm/convert/int4.py) against compressed-tensors' own, the format's reference
(compressed_tensors 0.18.0: calculate_qparams, quantize, pack_to_int32, unpack_from_int32): what the
weight sync sends must be what llm-compressor would have written for the same weights, bit for bit,
because SGLang repacks exactly those words and scales for Marlin."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("compressed_tensors")
from rlslurm.convert import int4  # noqa: E402
from rlslurm.errors import DataError  # noqa: E402
from tests.helpers.int4_ckpt import ct_dequantize, ct_quantize  # noqa: E402


@pytest.mark.parametrize("shape, group", [((64, 256), 128), ((48, 384), 128), ((16, 64), 32), ((8, 7168), 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_and_pack_equal_compressed_tensors_bit_for_bit(shape, group, dtype) -> None:
    torch.manual_seed(0)
    w = (torch.randn(*shape) * 0.02).to(torch.bfloat16)
    w[0, :group] = 0          # an all-zero group: the dtype's eps, never 0/0
    w[1, :group] *= 1000      # a group with an outlier
    packed, scale = int4.quantize(w.to(dtype), group)  # an fp32 trainer's export is cast to the scale's dtype
    ref_packed, ref_scale = ct_quantize(w, group)
    assert packed.dtype == torch.int32 and packed.shape == (shape[0], shape[1] // 8)
    assert torch.equal(packed, ref_packed) and torch.equal(scale, ref_scale)
    assert not torch.isnan(scale.float()).any() and (scale > 0).all()


def test_dequantize_equals_compressed_tensors_decompress() -> None:
    torch.manual_seed(1)
    w = torch.randn(32, 256).to(torch.bfloat16)
    packed, scale = ct_quantize(w, 128)
    mine = int4.dequantize(packed, scale, torch.tensor([32, 256]), 128)
    assert mine.dtype == torch.float32
    assert torch.equal(mine.to(torch.bfloat16), ct_dequantize(packed, scale, torch.tensor([32, 256])))


@pytest.mark.parametrize("k", [8, 12, 32, 100])
def test_pack_unpack_match_compressed_tensors_with_a_partial_last_word(k: int) -> None:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    q = torch.randint(-8, 8, (5, k), dtype=torch.int8)
    assert torch.equal(int4.pack(q), pack_to_int32(q, 4))
    assert torch.equal(int4.unpack(int4.pack(q), k), q)
    assert torch.equal(int4.unpack(pack_to_int32(q, 4), k), unpack_from_int32(pack_to_int32(q, 4), 4, q.shape))


def test_quantize_dequantize_stays_within_half_a_step() -> None:
    torch.manual_seed(2)
    w = torch.randn(16, 256).to(torch.bfloat16)
    packed, scale = int4.quantize(w, 128)
    back = int4.dequantize(packed, scale, torch.tensor([16, 256]), 128)
    step = scale.float().repeat_interleave(128, 1)
    assert ((w.float() - back).abs() <= step * 0.5 + w.float().abs() * 2**-8).all()


@pytest.mark.parametrize("packed_shape, scale_shape, shape, why", [
    ((4, 31), (4, 2), [4, 256], "packs into int32 (4, 32)"),
    ((4, 32), (4, 3), [4, 256], "needs (4, 2)"),
    ((4, 32), (4, 2), [4, 250], "not a whole number of 128-column groups"),
    ((4, 32), (4, 2), [4, 256, 1], "not the two of a 2-D weight"),
])
def test_a_malformed_int4_tensor_is_one_line_naming_it(packed_shape, scale_shape, shape, why) -> None:
    with pytest.raises(DataError) as e:
        int4.dequantize(torch.zeros(packed_shape, dtype=torch.int32), torch.ones(scale_shape, dtype=torch.bfloat16),
                        torch.tensor(shape), 128, name="model.layers.0.mlp.experts.0.up_proj", where="/ckpt")
    assert why in str(e.value) and "model.layers.0.mlp.experts.0.up_proj" in str(e.value) and "\n" not in str(e.value)


def test_export_sends_weight_packed_scale_shape_and_keeps_the_rest() -> None:
    """The names the checkpoint stored in INT4 go out as X.weight_packed (in the weight's place),
    X.weight_scale and X.weight_shape; every other tensor (the ignore list's modules) unchanged."""
    torch.manual_seed(3)
    e = "model.layers.0.mlp.experts.0.down_proj.weight"
    attn = "model.layers.0.self_attn.q_proj.weight"
    big = "model.embed_tokens.weight"
    exp = int4.Int4Export(128, frozenset({e}))
    stream = [(big, torch.randn(1024, 1024).to(torch.bfloat16)), (e, torch.randn(64, 256).to(torch.bfloat16)),
              (attn, torch.randn(64, 64).to(torch.bfloat16)), ("model.norm.weight", torch.ones(64))]
    out = list(exp.quantize(iter(stream)))
    names = [n for n, _ in out]
    assert names[:2] == [big, "model.layers.0.mlp.experts.0.down_proj.weight_packed"]
    got = dict(out)
    assert set(got) == {big, attn, "model.norm.weight"} | {e[: -len("weight")] + s for s in
                                                           ("weight_packed", "weight_scale", "weight_shape")}
    assert got[e[: -len("weight")] + "weight_shape"].dtype == torch.int64
    assert got[e[: -len("weight")] + "weight_shape"].tolist() == [64, 256]
    assert torch.equal(got[attn], stream[2][1])
    assert torch.equal(got[e[: -len("weight")] + "weight_packed"], ct_quantize(stream[1][1], 128)[0])
