"""INT4 W4A16 compressed-tensors checkpoints (slime's INT4 recipes): the packing math and the two
places it runs.

The layout (docs/low-precision.md, "INT4 W4A16 checkpoints"): each INT4 linear weight `W` [N, K] is
stored as three tensors in place of `X.weight`:
- `X.weight_packed`, int32 [N, ceil(K / 8)]: eight 4-bit values a word, value j of a word in bits
  4j..4j+3, each stored as q + 8 (q in -8..7), the last word zero-padded;
- `X.weight_scale` [N, K / g] in the checkpoint's float dtype, one scale per group of g columns;
- `X.weight_shape`, the two ints (N, K).
`W[i, j] = q[i, j] * weight_scale[i, j // g]`. compressed-tensors' pack-quantized compressor writes
it so (pack_to_int32 / unpack_from_int32, compressed_tensors 0.18.0), and SGLang's
CompressedTensorsWNA16MoE registers exactly those parameters per expert before it repacks them for
Marlin. Which weights are INT4 is the checkpoint's own business (its `ignore` list decided it when
it was made): rlslurm reads it off the tensors (the names with a `weight_packed`), so what it writes
back has the checkpoint's names, dtypes and shapes whatever the list says.

- `dequantizing(ckpt, group)`: a getter for the HF -> Megatron load (convert/load.py) that hands out
  `X.weight` multiplied out to float32 where the checkpoint has `X.weight_packed`.
- `Int4Export`: the quantizer of a weight sync or disk export (trainer/weights/): the trained weights
  the checkpoint stored in INT4 go out as `weight_packed` + `weight_scale` + `weight_shape` again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from rlslurm.convert.quant_stream import small_last
from rlslurm.errors import DataError
from rlslurm.settings.low_precision import PACKED, SCALE, SHAPE, check_int4_tensors

BITS = 4
PER_WORD = 32 // BITS         # 8 values per int32 word
OFFSET = 1 << (BITS - 1)      # stored value = q + 8, so 0..15
Q_MIN, Q_MAX = -OFFSET, OFFSET - 1
# symmetric scale = the group's largest |w| / 7.5: half the int4 range (15 / 2), as compressed-tensors'
# calculate_qparams computes it (quantization/utils/helpers.py), so that both -8 and 7 are used
HALF_RANGE = (Q_MAX - Q_MIN) / 2


def pack(q: torch.Tensor) -> torch.Tensor:
    """int values in -8..7 [N, K] -> int32 [N, ceil(K / 8)], value j of each word in bits 4j..4j+3."""
    u = q.to(torch.int32) + OFFSET
    n, k = u.shape
    words = -(-k // PER_WORD)
    u = torch.nn.functional.pad(u, (0, words * PER_WORD - k))  # padding is stored as 0, not as q = 0
    u = u.reshape(n, words, PER_WORD)
    out = torch.zeros(n, words, dtype=torch.int32, device=q.device)
    for j in range(PER_WORD):
        # the shift of value 7 by 28 sets the sign bit: int32 wraps, the bits are what matter
        out |= u[:, :, j] << (BITS * j)
    return out


def unpack(packed: torch.Tensor, k: int) -> torch.Tensor:
    """int32 [N, W] -> int8 [N, k] in -8..7 (the inverse of `pack`)."""
    n, words = packed.shape
    fields = [(packed >> (BITS * j)) & 0xF for j in range(PER_WORD)]  # arithmetic shift, then masked
    u = torch.stack(fields, dim=-1).reshape(n, words * PER_WORD)[:, :k]
    return (u - OFFSET).to(torch.int8)


def _check(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor, group: int, name: str,
           where: str) -> tuple[int, int]:
    if shape.numel() != 2:
        raise DataError(where, f"{name}.{SHAPE} has {shape.numel()} values, not the two of a 2-D weight")
    n, k = (int(v) for v in shape.reshape(-1).tolist())
    if k % group:
        raise DataError(where, f"{name}: input dim {k} is not a whole number of {group}-column groups")
    want_p, want_s = (n, -(-k // PER_WORD)), (n, k // group)
    if packed.dtype != torch.int32 or tuple(packed.shape) != want_p:
        raise DataError(where, f"{name}.{PACKED} is {packed.dtype} {tuple(packed.shape)}; a [{n}, {k}] weight "
                        f"packs into int32 {want_p}")
    if tuple(scale.shape) != want_s:
        raise DataError(where, f"{name}.{SCALE} has shape {tuple(scale.shape)}, but [{n}, {k}] in groups of "
                        f"{group} needs {want_s}")
    return n, k


def dequantize(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor, group: int, *,
               name: str = "weight", where: str = "checkpoint") -> torch.Tensor:
    """q * scale per group, in float32 (the loader casts to the training dtype once: with a bf16
    scale that equals compressed-tensors' own dequantize, which multiplies in bf16)."""
    n, k = _check(packed, scale, shape, group, name, where)
    q = unpack(packed, k).to(torch.float32)
    return q * scale.to(torch.float32).repeat_interleave(group, dim=1)


def quantize(w: torch.Tensor, group: int, scale_dtype: torch.dtype = torch.bfloat16
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight_packed int32, weight_scale in `scale_dtype`) of `w` [N, K], symmetric per group of
    `group` columns. Every step is compressed-tensors' (calculate_qparams, then quantize) in the same
    dtype, so the result is bit for bit what it writes for the same input: scale = the group's
    largest |w| / 7.5 (an all-zero group gets the dtype's eps, never 0), q = round(clamp(w / scale,
    -8, 7)) with w / scale rounded to `scale_dtype` first, as it divides in the weight's dtype."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"input dim {k} is not a whole number of {group}-column groups")
    x = w.detach().to(scale_dtype).reshape(n, k // group, group)
    amax = torch.maximum(x.amin(dim=-1).clamp(max=0).abs(), x.amax(dim=-1).clamp(min=0))
    scale = amax / HALF_RANGE
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(scale_dtype).eps, dtype=scale_dtype,
                                                  device=scale.device), scale)
    q = torch.round(torch.clamp(x / scale.unsqueeze(-1), Q_MIN, Q_MAX)).to(torch.int8)
    return pack(q.reshape(n, k)), scale.contiguous()


def dequantizing(ckpt, group: int) -> Callable[[str], torch.Tensor]:
    """`ckpt.get` (hf_io.HFCheckpoint), with `X.weight` multiplied out of `X.weight_packed`, its scale
    and shape wherever the checkpoint stores X in INT4."""
    where = str(ckpt.dir)

    def get(name: str) -> torch.Tensor:
        if name.endswith(".weight") and name not in ckpt and name[: -len("weight")] + PACKED in ckpt:
            base = name[: -len("weight")]
            for part in (SCALE, SHAPE):
                if base + part not in ckpt:
                    raise DataError(where, f"INT4 tensor {base + PACKED!r} has no {base + part!r} beside it "
                                    "(docs/low-precision.md)")
            return dequantize(ckpt.get(base + PACKED), ckpt.get(base + SCALE), ckpt.get(base + SHAPE), group,
                              name=name[: -len(".weight")], where=where)
        return ckpt.get(name)

    return get


@dataclass(frozen=True)
class Int4Export:
    """What a sync or disk export quantizes: the HF weights the checkpoint stored in INT4, with the
    dtypes it stored their scales and shapes in."""

    group: int
    names: frozenset[str]                     # `X.weight` of each INT4 X
    scale_dtype: torch.dtype = torch.bfloat16
    shape_dtype: torch.dtype = torch.int64    # compressed-tensors writes torch.tensor(weight.shape)

    @classmethod
    def of_checkpoint(cls, hf_dir: str | Path, group: int) -> "Int4Export":
        from rlslurm.convert.hf_io import HFCheckpoint

        ckpt = HFCheckpoint(hf_dir)
        bases = check_int4_tensors(Path(hf_dir), "--hf-checkpoint", ckpt.names())
        if not bases:
            raise DataError(str(hf_dir), f"config.json says INT4, but no tensor is *.{PACKED} (docs/low-precision.md)")
        return cls(group, frozenset(b + "weight" for b in bases), ckpt.get(bases[0] + SCALE).dtype,
                   ckpt.get(bases[0] + SHAPE).dtype)

    def quantize(self, stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The export stream with each listed weight as weight_packed + weight_scale + weight_shape: the
        packed words where the weight was, the scales and shapes after the big tensors
        (convert/quant_stream.py says why; /end_weight_update repacks them for Marlin)."""
        def one(name: str, t: torch.Tensor):
            base = name[: -len("weight")]
            packed, scale = quantize(t, self.group, self.scale_dtype)
            shape = torch.tensor(tuple(t.shape), dtype=self.shape_dtype, device=t.device)
            return [(base + PACKED, packed)], [(base + SCALE, scale), (base + SHAPE, shape)]

        return small_last(stream, self.names, one)
