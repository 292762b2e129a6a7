"""`--prompt-data DIR`: a directory of prompt shards, or a Hugging Face `datasets` save directory.

- A directory of shards: its `.jsonl` and `.parquet` files (not subdirectories; not `.json`, which
  in a data directory is usually metadata such as a README's card), in name order, read as one
  sequence of records. Record numbers, slices (`DIR@[0:1000]`) and the cursor run over that sequence.
- `Dataset.save_to_disk(DIR)`: `state.json` lists its Arrow files (IPC stream format, rows already in
  the dataset's order: `save_to_disk` writes a selected or shuffled dataset's rows, not its indices;
  checked with datasets 3.6.0). They are memory-mapped, so a large dataset is not loaded whole.
  A `DatasetDict` (`dataset_dict.json`) is refused naming its splits: one split is one run's prompts.
- A path that does not exist and reads like `owner/name` is probably a Hub dataset id: the nodes read
  local files only (they may have no network), so the error says to download it first.

A reader here has the interface of rlslurm/rollout/prompt_records.py's record readers: `len`, `where(i)`
(`file:line` or `file:row N` for errors), `read(i)` and `close()`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from rlslurm.errors import DataError
from rlslurm.settings.paths import hub_id_of

SHARD_SUFFIXES = (".jsonl", ".parquet")
class Records(Protocol):
    def __len__(self) -> int: ...

    def where(self, i: int) -> str: ...

    def read(self, i: int) -> dict[str, Any] | None: ...

    def close(self) -> None: ...


def missing_path_hint(path: Path, flag: str) -> str:
    """Why a prompt path does not exist, when it reads like a Hub dataset id ('' otherwise). The path
    has been made absolute at submit, so the id is its last two components, neither of which exists."""
    hub_id = hub_id_of(path)
    if hub_id is None or path.suffix.lower() in (*SHARD_SUFFIXES, ".json"):
        return ""
    return (f"; if {hub_id!r} is a Hugging Face Hub dataset, download it first (the nodes read local files only): "
            f"hf download {hub_id} --repo-type dataset --local-dir data/{path.name}, then {flag} with the "
            f"directory of its .parquet/.jsonl files")


def shard_files(path: Path, flag: str) -> tuple[str, list[Path]]:
    """("arrow", files) of a `datasets` save directory, or ("shards", files) of a shard directory."""
    if (path / "dataset_dict.json").is_file():
        splits = _json(path / "dataset_dict.json").get("splits") or sorted(p.name for p in path.iterdir() if p.is_dir())
        raise DataError(str(path), f"a `datasets` DatasetDict with splits {', '.join(map(str, splits))}: pass one "
                                   f"split's directory, e.g. {flag} {path / str(splits[0])}")
    if (path / "state.json").is_file():
        state = _json(path / "state.json")
        names = [f.get("filename") for f in state.get("_data_files", []) if isinstance(f, dict)]
        files = [path / n for n in names if n] or sorted(path.glob("*.arrow"))
        missing = [f.name for f in files if not f.is_file()]
        if not files or missing:
            raise DataError(str(path / "state.json"), f"a `datasets` save directory whose Arrow files are missing "
                                                      f"({', '.join(missing) or 'none listed'})")
        return "arrow", files
    shards = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in SHARD_SUFFIXES
                    and not p.name.startswith("."))
    if not shards:
        subdirs = [d for d in sorted(path.iterdir()) if d.is_dir() and any(
            f.suffix.lower() in SHARD_SUFFIXES or f.name == "state.json" for f in d.iterdir() if f.is_file())]
        hint = f"; {subdirs[0].name}/ has some: {flag} {subdirs[0]}" if subdirs else ""
        raise DataError(str(path), f"no .jsonl or .parquet files in this directory (a save_to_disk directory has "
                                   f"state.json){hint}")
    return "shards", shards


def open_dir(path: Path, open_file: Callable[[Path], Records], columns: Sequence[str],
             required: Sequence[tuple[str, str]], flag: str) -> "ShardedRecords":
    """The directory's records as one sequence; `open_file` opens one .jsonl/.parquet shard."""
    kind, files = shard_files(path, flag)
    readers: list[Records] = []
    try:
        for f in files:
            readers.append(ArrowRecords(f, columns, required) if kind == "arrow" else open_file(f))
    except BaseException:
        for r in readers:
            r.close()
        raise
    return ShardedRecords(readers)


def dir_digest(path: Path, flag: str, file_digest: Callable[[Path], dict[str, Any]]) -> list[dict[str, Any]]:
    """Each shard's name and digest: a cursor saved for other shards is not this directory's."""
    return [{"name": f.name, **file_digest(f)} for f in shard_files(path, flag)[1]]


def dir_bytes(path: Path, flag: str) -> int:
    return sum(f.stat().st_size for f in shard_files(path, flag)[1])


class ShardedRecords:
    """Several readers as one: record i is in the shard whose range holds it."""

    def __init__(self, readers: Sequence[Records]):
        self.readers = list(readers)
        self.starts = np.concatenate([[0], np.cumsum([len(r) for r in self.readers])]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _locate(self, i: int) -> tuple[Records, int]:
        s = int(np.searchsorted(self.starts, i, side="right") - 1)
        return self.readers[s], i - int(self.starts[s])

    def where(self, i: int) -> str:
        reader, j = self._locate(i)
        return reader.where(j)

    def read(self, i: int) -> dict[str, Any] | None:
        reader, j = self._locate(i)
        return reader.read(j)

    def close(self) -> None:
        for r in self.readers:
            r.close()


class ArrowRecords:
    """Rows of one Arrow IPC stream file (a `datasets` shard), memory-mapped."""

    def __init__(self, path: Path, columns: Sequence[str], required: Sequence[tuple[str, str]]):
        import pyarrow as pa

        self.path = path
        try:
            table = pa.ipc.open_stream(pa.memory_map(str(path))).read_all()
        except Exception as e:
            raise DataError(str(path), f"cannot read Arrow file: {e}") from None
        names = table.column_names
        for key, key_flag in required:
            if key not in names:
                raise DataError(str(path), f"no column {key!r} for {key_flag} (columns: {', '.join(names)})")
        self._table = table.select([c for c in dict.fromkeys(columns) if c in names])

    def __len__(self) -> int:
        return self._table.num_rows

    def where(self, i: int) -> str:
        return f"{self.path}:row {i + 1}"

    def read(self, i: int) -> dict[str, Any] | None:
        return self._table.slice(i, 1).to_pylist()[0]

    def close(self) -> None:
        self._table = self._table.slice(0, 0)


def _json(path: Path) -> dict[str, Any]:
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(str(path), f"cannot read it as JSON: {e}") from None
    if not isinstance(obj, dict):
        raise DataError(str(path), "expected a JSON object")
    return obj
