"""Reading and writing HF safetensors checkpoints, tensor by tensor.

Reading never loads a whole checkpoint: `HFCheckpoint` opens each shard lazily (through the
`model.safetensors.index.json` when there is one) and hands out single tensors. Writing follows
the shared-filesystem rules: every file goes to a temp name in the same directory, is fsynced and
renamed; the index (the manifest of a sharded checkpoint) is written last.

Importing this module imports no torch: submit's checks of a checkpoint (rlslurm/preflight.py) run on
login nodes that may have none. The tensor names come from each file's header, which is JSON: an
8-byte little-endian length, then that many bytes of {name: {dtype, shape, data_offsets}, "__metadata__": ...}
(the safetensors format).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

from rlslurm.buffer.atomic import retry_transient
from rlslurm.errors import ConfigError, DataError
from rlslurm.safetensors_names import INDEX_NAME, safetensors_header

if TYPE_CHECKING:
    import torch

SINGLE_NAME = "model.safetensors"
# Files besides the weights that make a directory a usable HF model (tokenizer, generation config).
AUX_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
             "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")


class HFCheckpoint:
    """Lazy, name-addressed access to the tensors of an HF safetensors checkpoint directory."""

    def __init__(self, hf_dir: str | Path):
        from safetensors import safe_open

        self.dir = Path(hf_dir)
        if not self.dir.is_dir():
            raise ConfigError(f"{self.dir}: HF checkpoint directory does not exist")
        index = self.dir / INDEX_NAME
        self._where: dict[str, Path] = {}
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise DataError(str(index), f"not a safetensors index ({e})") from None
            for name, shard in weight_map.items():
                self._where[name] = self.dir / shard
        else:
            shards = sorted(self.dir.glob("*.safetensors"))
            if not shards:
                raise ConfigError(f"{self.dir}: no *.safetensors files and no {INDEX_NAME}")
            for shard in shards:
                for name in sorted(safetensors_header(shard)):  # as safetensors lists them
                    self._where[name] = shard
        self._open: dict[Path, object] = {}
        self._safe_open = safe_open

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        shard = self._where.get(name)
        if shard is None:
            raise DataError(str(self.dir), f"tensor {name!r} is missing from the checkpoint")
        f = self._open.get(shard)
        if f is None:
            if not shard.exists():
                raise DataError(str(shard), f"shard listed in {INDEX_NAME} does not exist")
            f = self._safe_open(str(shard), framework="pt")
            self._open[shard] = f
        return f.get_tensor(name)  # type: ignore[attr-defined]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self._where:
            yield name, self.get(name)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    """Temp + fsync + rename; a transient error of a shared filesystem (EIO, ESTALE, EAGAIN) writes it
    again whole (buffer/atomic.py `retry_transient`, its bounds): the bytes are in memory."""
    def once() -> None:
        tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    retry_transient(once, path, f"writing {path.name}")


def save_hf_checkpoint(
    tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | Path,
    *,
    config: dict | None = None,
    copy_aux_from: str | Path | None = None,
    max_shard_bytes: int = 2 * 1024**3,
) -> dict[str, int]:
    """Write `(name, tensor)` pairs as safetensors shards + index; returns {'tensors', 'bytes'}.

    Tensors are buffered only up to `max_shard_bytes`, so an exporter's stream is never held whole.
    """
    from safetensors.torch import save as st_save

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    shard_names: list[str] = []
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = total_bytes = count = 0

    def flush() -> None:
        nonlocal pending, pending_bytes
        if not pending:
            return
        name = f"model-{len(shard_names) + 1:05d}.safetensors"
        _atomic_write_bytes(out / name, st_save(pending, metadata={"format": "pt"}))
        for k in pending:
            weight_map[k] = name
        shard_names.append(name)
        pending, pending_bytes = {}, 0

    for name, t in tensors:
        if name in pending or name in weight_map:
            raise ValueError(f"save_hf_checkpoint: tensor {name!r} written twice")
        nbytes = t.numel() * t.element_size()
        if pending and pending_bytes + nbytes > max_shard_bytes:
            flush()
        pending[name] = t.detach().contiguous().cpu()
        pending_bytes += nbytes
        total_bytes += nbytes
        count += 1
    flush()
    # Single shard: the conventional name, no index (what HF writes for small models).
    if len(shard_names) == 1:
        os.replace(out / shard_names[0], out / SINGLE_NAME)
        stale = out / INDEX_NAME
        if stale.exists():
            stale.unlink()
    else:
        total = len(shard_names)
        renamed = {}
        for i, old in enumerate(shard_names, 1):
            new = f"model-{i:05d}-of-{total:05d}.safetensors"
            os.replace(out / old, out / new)
            renamed[old] = new
        index = {"metadata": {"total_size": total_bytes},
                 "weight_map": {k: renamed[v] for k, v in sorted(weight_map.items())}}
        _atomic_write_bytes(out / INDEX_NAME, json.dumps(index, indent=2).encode())
    if copy_aux_from is not None:
        for aux in AUX_FILES:
            src = Path(copy_aux_from) / aux
            if src.exists():
                retry_transient(lambda src=src, aux=aux: shutil.copyfile(src, out / aux), out / aux, "copying it")
    if config is not None:  # last: a directory with config.json is a complete model
        _atomic_write_bytes(out / "config.json", json.dumps(config, indent=2).encode())
    _fsync_dir(out)
    return {"tensors": count, "bytes": total_bytes}
