"""Rollout data file format: safetensors layout, written and read by us.

Why this format (numbers in bench/results/buffer-*.md):
- no pickle: a run directory may be shared or copied, and unpickling it would run code;
- the per-token fields of all samples are concatenated into a handful of flat arrays
  (tokens, logprobs, mask + offsets), so writing is a few large `os.write`s of numpy
  memory and reading is one `readinto` plus `np.frombuffer` views - no per-token
  Python work either way;
- the file is a valid safetensors file (8-byte header length, JSON header, raw
  little-endian data), so `safetensors.safe_open` and other tools can read it;
- per-sample scalars (reward, status, label, metadata) are one JSON document in the
  header's `__metadata__`, because they are small and free-form.
We write the layout ourselves rather than through `safetensors.numpy.save` because that
needs every field concatenated into one array and then copies all of it into one
`bytes`; we hand the kernel each sample's arrays directly (gathered writes).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlslurm.buffer.sample import LOGPROB_DTYPE, MASK_DTYPE, TOKEN_DTYPE, Sample, SampleStatus
from rlslurm.errors import DataError

FORMAT = "rlslurm-rollout-v1"

_DTYPES = {"I64": np.int64, "I32": np.int32, "U8": np.uint8, "F32": np.float32, "F64": np.float64}
_STATUS = {st.value: st for st in SampleStatus}
_NAMES = {np.dtype(v).str: k for k, v in _DTYPES.items()}  # little-endian numpy names


@dataclass
class Encoded:
    """An encoded rollout: the chunks to write, in order, and their total size."""

    chunks: list[memoryview]
    size: int


def encode(samples: list[Sample]) -> Encoded:
    """Lay the samples out as one safetensors file. Per-sample arrays are not
    concatenated in memory: each becomes its own chunk and the file is written with
    gathered writes, so the ~10 MB of a large rollout is copied only by the kernel."""
    n = len(samples)
    p_len = np.fromiter((s.prompt_tokens.shape[0] for s in samples), dtype=np.int64, count=n)
    r_len = np.fromiter((s.response_tokens.shape[0] for s in samples), dtype=np.int64, count=n)
    p_off = np.zeros(n + 1, dtype=np.int64)
    r_off = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(p_len, out=p_off[1:])
    np.cumsum(r_len, out=r_off[1:])
    has_lp = np.fromiter((s.rollout_logprobs is not None for s in samples), dtype=np.uint8, count=n)

    # name -> (dtype, parts); 8-byte dtypes first, then 4, then 1: every tensor stays aligned
    tensors: dict[str, tuple[np.dtype, list[np.ndarray]]] = {
        "prompt_offsets": (np.dtype("<i8"), [p_off]),
        "response_offsets": (np.dtype("<i8"), [r_off]),
        "prompt_tokens": (np.dtype(TOKEN_DTYPE), [s.prompt_tokens for s in samples]),
        "response_tokens": (np.dtype(TOKEN_DTYPE), [s.response_tokens for s in samples]),
    }
    if has_lp.any():
        tensors["rollout_logprobs"] = (
            np.dtype(LOGPROB_DTYPE),
            [
                s.rollout_logprobs if s.rollout_logprobs is not None
                else np.full(s.response_length, np.nan, LOGPROB_DTYPE)
                for s in samples
            ],
        )
    tensors["loss_mask"] = (np.dtype(MASK_DTYPE), [s.effective_loss_mask() for s in samples])
    tensors["has_logprobs"] = (np.dtype(MASK_DTYPE), [has_lp])

    scalars = [
        {
            "reward": s.reward,
            "reward_key": s.reward_key,
            "status": s.status.value,
            "group_index": s.group_index,
            "index": s.index,
            "weight_version": s.weight_version,
            "label": s.label,
            "metadata": s.metadata,
        }
        for s in samples
    ]
    header: dict[str, Any] = {}
    body: list[memoryview] = []
    offset = 0
    for name, (dtype, parts) in tensors.items():
        dtype = dtype.newbyteorder("<")
        nbytes = 0
        count = 0
        for a in parts:
            a = np.ascontiguousarray(a, dtype=dtype)  # no copy when already right (the usual case)
            if a.nbytes:
                body.append(memoryview(a).cast("B"))
            nbytes += a.nbytes
            count += a.shape[0]
        header[name] = {"dtype": _NAMES[dtype.str], "shape": [count], "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    try:
        samples_json = json.dumps(scalars, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise DataError("rollout samples", f"reward/label/metadata must be JSON-serialisable and finite: {e}") from e
    header["__metadata__"] = {"format": FORMAT, "samples": samples_json}
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * (-(8 + len(hbytes)) % 8)  # data starts 8-byte aligned
    chunks = [memoryview(struct.pack("<Q", len(hbytes))), memoryview(hbytes), *body]
    return Encoded(chunks=chunks, size=8 + len(hbytes) + offset)


def decode(buf: bytes | bytearray | memoryview, where: str) -> list[Sample]:
    """Parse a data file whose size and checksum were already verified. Any structural
    problem (a foreign or buggy file) is a DataError naming `where`."""
    view = memoryview(buf)
    try:
        (hlen,) = struct.unpack_from("<Q", view, 0)
        header = json.loads(bytes(view[8 : 8 + hlen]))
        meta = header.pop("__metadata__")
        if meta.get("format") != FORMAT:
            raise ValueError(f"format is {meta.get('format')!r}, expected {FORMAT!r}")
        scalars = json.loads(meta["samples"])
        data = view[8 + hlen :]
        arrays: dict[str, np.ndarray] = {}
        for name, info in header.items():
            begin, end = info["data_offsets"]
            if not 0 <= begin <= end <= len(data):
                raise ValueError(f"tensor {name} lies outside the file")
            dtype = np.dtype(_DTYPES[info["dtype"]])
            a = np.frombuffer(data[begin:end], dtype=dtype)
            a.flags.writeable = False  # samples share one buffer; a stray in-place edit must not leak
            arrays[name] = a.reshape(info["shape"])
        n = len(scalars)
        p_off, r_off = arrays["prompt_offsets"], arrays["response_offsets"]
        if p_off.shape != (n + 1,) or r_off.shape != (n + 1,):
            raise ValueError("offset arrays do not match the number of samples")
        p_tok, r_tok, mask = arrays["prompt_tokens"], arrays["response_tokens"], arrays["loss_mask"]
        lp = arrays.get("rollout_logprobs")
        has_lp = arrays["has_logprobs"]
        if p_off[-1] != p_tok.shape[0] or r_off[-1] != r_tok.shape[0] or mask.shape[0] != r_tok.shape[0]:
            raise ValueError("token arrays do not match their offsets")
        samples = []
        for i, sc in enumerate(scalars):
            rs, re_ = int(r_off[i]), int(r_off[i + 1])
            samples.append(
                Sample.trusted(
                    prompt_tokens=p_tok[int(p_off[i]) : int(p_off[i + 1])],
                    response_tokens=r_tok[rs:re_],
                    reward=sc["reward"],
                    reward_key=sc["reward_key"],
                    loss_mask=mask[rs:re_],
                    rollout_logprobs=lp[rs:re_] if (lp is not None and has_lp[i]) else None,
                    status=_STATUS[sc["status"]],
                    group_index=sc["group_index"],
                    index=sc["index"],
                    weight_version=sc["weight_version"],
                    label=sc["label"],
                    metadata=sc["metadata"],
                )
            )
        return samples
    except DataError:
        raise
    except (ValueError, KeyError, TypeError, struct.error, json.JSONDecodeError) as e:
        raise DataError(where, f"not a valid rollout data file: {e}") from e
