"""Block-wise FP8 checkpoints (Qwen's *-FP8 releases): the block math and the two places it runs.

The layout (docs/low-precision.md, "Block-wise FP8 checkpoints"): each quantized linear weight
`W` [N, K] is stored as `W_q` (float8_e4m3fn, same shape) plus `<name>_scale_inv` (float32,
[ceil(N/bn), ceil(K/bk)]), and `W[i, j] = W_q[i, j] * scale_inv[i // bn, j // bk]`. SGLang's
Fp8LinearMethod registers exactly that `weight_scale_inv` parameter per linear (fp32, ceil-div
shape) and multiplies it back in its block-FP8 GEMM; transformers' Fp8Dequantize does the same
product in fp32. Which weights are quantized is the checkpoint's own business (a
`modules_to_not_convert` list, or simply which names have a `_scale_inv`): rlslurm reads it off the
tensors, so what it writes back has the names, dtypes and shapes of the checkpoint.

- `dequantizing(ckpt, block)`: a getter for the HF -> Megatron load (convert/load.py) that hands
  out each FP8 weight multiplied out to float32; the `_scale_inv` tensors are consumed there and
  never reach the mapping.
- `Fp8Export`: the quantizer of a weight sync or disk export (trainer/weights/): the trained
  weights the checkpoint stored in FP8 go out as FP8 + `_scale_inv` again, block by block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from rlslurm.convert.quant_stream import small_last
from rlslurm.errors import DataError

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448: the largest finite e4m3fn value
SCALE_SUFFIX = "_scale_inv"
# an all-zero block (padding, an expert that never trained) would give scale 0 and 0/0 = NaN;
# slime's converter hit exactly that (THUDM/slime tests/test_block_fp8_zero_block.py)
MIN_AMAX = 1e-12


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    n, k = shape
    return math.ceil(n / block[0]), math.ceil(k / block[1])


def _expand(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """The per-block scale broadcast to every element (partial edge blocks cropped)."""
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return full[: shape[0], : shape[1]]


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], *, name: str = "weight",
               where: str = "checkpoint") -> torch.Tensor:
    """W_q * scale_inv per block, in float32 (the loader casts to the training dtype once)."""
    if q.dim() != 2 or tuple(scale_inv.shape) != scale_shape(tuple(q.shape), block):
        raise DataError(where, f"{name}{SCALE_SUFFIX} has shape {tuple(scale_inv.shape)}, but {name} "
                        f"{tuple(q.shape)} in {block[0]}x{block[1]} blocks needs "
                        f"{scale_shape(tuple(q.shape), block) if q.dim() == 2 else 'a 2-D weight'}")
    return q.to(torch.float32) * _expand(scale_inv.to(torch.float32), tuple(q.shape), block)


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_q float8_e4m3fn, scale_inv float32): each block scaled so its largest |w| maps to 448,
    as slime's and SGLang's block quantizers do (scale_inv = amax / 448)."""
    n, k = w.shape
    bn, bk = block
    sn, sk = scale_shape((n, k), block)
    x = torch.nn.functional.pad(w.to(torch.float32), (0, sk * bk - k, 0, sn * bn - n))
    blocks = x.reshape(sn, bn, sk, bk)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=MIN_AMAX)
    scale_inv = amax / FP8_MAX
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(sn * bn, sk * bk)[:n, :k].contiguous(), scale_inv.contiguous()


def quantized_names(names: Iterable[str]) -> frozenset[str]:
    """The weights a checkpoint stores in FP8: those with a `<name>_scale_inv` beside them."""
    names = set(names)
    return frozenset(n[: -len(SCALE_SUFFIX)] for n in names if n.endswith(SCALE_SUFFIX)
                     and n[: -len(SCALE_SUFFIX)] in names)


def dequantizing(ckpt, block: tuple[int, int] | None) -> Callable[[str], torch.Tensor]:
    """`ckpt.get`, with every FP8 weight multiplied out by its blocks (`ckpt`: hf_io.HFCheckpoint).
    `block` None: the checkpoint is not quantized, and an FP8 tensor in it is an error."""
    where = str(ckpt.dir)

    def get(name: str) -> torch.Tensor:
        t = ckpt.get(name)
        if t.dtype != FP8:
            if t.dtype in (torch.float8_e5m2, torch.uint8, torch.int8, torch.int32):
                raise DataError(where, f"tensor {name!r} is {t.dtype}; rlslurm reads float8_e4m3fn weights with "
                                "128x128 float32 scale blocks only (docs/low-precision.md)")
            return t
        if block is None:
            raise DataError(where, f"tensor {name!r} is float8_e4m3fn, but config.json has no fp8 "
                            "quantization_config to say its block size (docs/low-precision.md)")
        scale = name + SCALE_SUFFIX
        if scale not in ckpt:
            raise DataError(where, f"FP8 tensor {name!r} has no {scale!r} beside it (docs/low-precision.md)")
        return dequantize(t, ckpt.get(scale), block, name=name, where=where)

    return get


@dataclass(frozen=True)
class Fp8Export:
    """What a sync or disk export quantizes: the HF weights the checkpoint stored in FP8."""

    block: tuple[int, int]
    names: frozenset[str]

    @classmethod
    def of_checkpoint(cls, hf_dir: str | Path, block: tuple[int, int]) -> "Fp8Export":
        from rlslurm.convert.hf_io import HFCheckpoint

        names = quantized_names(HFCheckpoint(hf_dir).names())
        if not names:
            raise DataError(str(hf_dir), "config.json says fp8, but no tensor has a *_scale_inv beside it "
                            "(docs/low-precision.md)")
        return cls(tuple(block), names)  # type: ignore[arg-type]

    def quantize(self, stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The export stream with each listed weight as FP8 + its `_scale_inv`, the scales after the big
        tensors (convert/quant_stream.py says why)."""
        def one(name: str, t: torch.Tensor):
            q, s = quantize(t, self.block)
            return [(name, q)], [(name + SCALE_SUFFIX, s)]

        return small_last(stream, self.names, one)
