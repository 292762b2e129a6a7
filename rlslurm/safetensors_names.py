"""A safetensors checkpoint's tensor names, read off its index or its files' headers: no tensor read,
no torch. Below rlslurm.settings, whose submit-time checks read them (settings/low_precision.py), and
rlslurm.convert, whose readers and writers do (convert/hf_io.py)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from rlslurm.errors import DataError

INDEX_NAME = "model.safetensors.index.json"


def safetensors_header(path: Path) -> dict[str, dict]:
    """{tensor name: {dtype, shape, data_offsets}} of one safetensors file, from its header (no tensor
    read, no torch); DataError naming the file when it is not one."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise DataError(str(path), "not a safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", head)
            if n > max(os.fstat(f.fileno()).st_size - 8, 0):
                raise DataError(str(path), f"not a safetensors file (header length {n} past the end of the file)")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise DataError(str(path), f"not a readable safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise DataError(str(path), "not a safetensors header (not a JSON object)")
    return {k: v for k, v in header.items() if k != "__metadata__"}


def checkpoint_names(hf_dir: str | Path) -> list[str]:
    """The tensor names of a safetensors checkpoint directory, off its index or its files' headers."""
    index = Path(hf_dir) / INDEX_NAME
    if index.is_file():
        try:
            return list(json.loads(index.read_text())["weight_map"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise DataError(str(index), f"not a safetensors index ({e})") from None
    return [name for shard in sorted(Path(hf_dir).glob("*.safetensors")) for name in safetensors_header(shard)]
