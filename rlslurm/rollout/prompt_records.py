"""The records of a prompt file: JSON Lines and parquet readers with random access, the fields a
record must carry, and the checks submit runs before anything is queued (`validate_prompt_file`,
`count_records`). rollout/data.py serves prompts from these in a resumable order; directories of
shards are rollout/data_dirs.py.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rlslurm.errors import ConfigError, DataError
from rlslurm.rollout import data_dirs
from rlslurm.settings.prompt_slice import PromptSpec, parse_prompt_spec

JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
_INDEX_CHUNK = 16 << 20
# One record (line) of a JSON Lines prompt file is read whole; past this it is refused instead. A
# prompt fits a model's context (128k tokens are < 1 MiB of text, an inline base64 image a few MiB):
# a longer line is a file that is not JSON Lines (one JSON array, no newlines), read whole otherwise.
MAX_LINE_BYTES = 64 << 20
_FINGERPRINT_BYTES = 64 << 10

PromptText = str | list[dict[str, Any]]


# --------------------------------------------------------------------------- records


class BadRecord(Exception):
    """A record that cannot be parsed (strict: DataError; lenient: counted and skipped)."""

    def __init__(self, where: str, message: str):
        self.where = where
        self.message = message
        super().__init__(f"{where}: {message}")


def file_format(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    raise DataError(str(path), f"unsupported prompt file type {suffix or '(no suffix)'!r}; use .jsonl or .parquet")


def check_exists(path: Path, flag: str = "--prompt-data") -> None:
    if not path.exists():
        raise DataError(str(path), f"prompt file does not exist{data_dirs.missing_path_hint(path, flag)}")
    if not path.is_file() and not path.is_dir():
        raise DataError(str(path), "prompt data path is not a file or a directory")


def _file_digest(path: Path) -> dict[str, Any]:
    h = hashlib.sha1()
    with open(path, "rb") as f:
        h.update(f.read(_FINGERPRINT_BYTES))
    return {"size": path.stat().st_size, "head_sha1": h.hexdigest()}


def fingerprint(path: Path, n_records: int, flag: str = "--prompt-data") -> dict[str, Any]:
    """Cheap identity of the data: a cursor into another file (or other shards) is meaningless."""
    if path.is_dir():
        return {"records": int(n_records), "shards": data_dirs.dir_digest(path, flag, _file_digest)}
    digest = _file_digest(path)
    return {"size": digest["size"], "records": int(n_records), "head_sha1": digest["head_sha1"]}


def open_records(path: Path, columns: Sequence[str], required: Sequence[tuple[str, str]],
                  flag: str = "--prompt-data") -> "JsonlRecords | ParquetRecords | data_dirs.ShardedRecords":
    """A reader of the records at `path`: a .jsonl/.parquet file, or a directory (data_dirs)."""
    def open_file(p: Path) -> JsonlRecords | ParquetRecords:
        return JsonlRecords(p) if file_format(p) == "jsonl" else ParquetRecords(p, columns, required)

    return data_dirs.open_dir(path, open_file, columns, required, flag) if path.is_dir() else open_file(path)


def key_columns(input_key: str, label_key: str | None, *more: str | None) -> tuple[list[str], list[tuple[str, str]]]:
    """The columns a columnar reader decodes, and those a record must have (with their flags)."""
    required = [(input_key, "--input-key")] + ([(label_key, "--label-key")] if label_key else [])
    return [c for c in (input_key, label_key, *more) if c], required


class JsonlRecords:
    """Random access to the non-empty lines of a JSON Lines file through an offset index."""

    def __init__(self, path: Path):
        self.path = path
        self.offsets, self.line_numbers = self._build_index(path)
        self._fh = open(path, "rb")

    @staticmethod
    def _build_index(path: Path) -> tuple[np.ndarray, np.ndarray]:
        offsets: list[np.ndarray] = []
        lines: list[np.ndarray] = []
        start = 0  # byte offset where the current (unterminated) line starts
        line_no = 1  # its 1-based line number
        pos = 0
        with open(path, "rb") as f:
            while chunk := f.read(_INDEX_CHUNK):
                nl = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10).astype(np.int64) + pos
                if nl.size:
                    starts = np.empty_like(nl)
                    starts[0] = start
                    starts[1:] = nl[:-1] + 1
                    keep = nl > starts  # drop empty lines here; whitespace-only ones at read time
                    offsets.append(starts[keep])
                    lines.append(np.arange(line_no, line_no + nl.size, dtype=np.int64)[keep])
                    start = int(nl[-1]) + 1
                    line_no += int(nl.size)
                pos += len(chunk)
        if pos > start:  # last line without a trailing newline
            offsets.append(np.array([start], dtype=np.int64))
            lines.append(np.array([line_no], dtype=np.int64))
        if not offsets:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return np.concatenate(offsets), np.concatenate(lines)

    def __len__(self) -> int:
        return int(self.offsets.shape[0])

    def where(self, i: int) -> str:
        return f"{self.path}:{int(self.line_numbers[i])}"

    def read(self, i: int) -> dict[str, Any] | None:
        """The record's object, None for a whitespace-only line; BadRecord if unparseable."""
        offset = int(self.offsets[i])
        self._fh.seek(offset)
        raw = self._fh.readline(MAX_LINE_BYTES + 1)
        where = self.where(i)
        if _too_long(raw):
            raise BadRecord(where, _too_long_message(raw))
        try:
            # editors on Windows start files with a byte-order mark; json.loads rejects it
            text = raw.decode("utf-8-sig" if offset == 0 else "utf-8")
        except UnicodeDecodeError as e:
            raise BadRecord(where, f"not valid UTF-8 ({e.reason} at byte {e.start})") from None
        if not text.strip():
            return None
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise BadRecord(where, f"invalid JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(obj, dict):
            hint = ""
            if text.lstrip()[:1] == "[":
                hint = " (a JSON array file is not JSON Lines: write one object per line)"
            raise BadRecord(where, f"expected a JSON object, got {type(obj).__name__}{hint}")
        return obj

    def close(self) -> None:
        self._fh.close()


class ParquetRecords:
    """Random access to parquet rows, decoding one row group at a time."""

    _CACHE = 2

    def __init__(self, path: Path, columns: Sequence[str], required: Sequence[tuple[str, str]]):
        import pyarrow.parquet as pq

        self.path = path
        try:
            self._pf = pq.ParquetFile(path)
        except Exception as e:
            raise DataError(str(path), f"cannot read parquet file: {e}") from None
        names = self._pf.schema_arrow.names
        for key, flag in required:
            if key not in names:
                raise DataError(str(path), f"no column {key!r} for {flag} (columns: {', '.join(names)})")
        self.columns = [c for c in dict.fromkeys(columns) if c in names]
        md = self._pf.metadata
        sizes = np.array([md.row_group(g).num_rows for g in range(md.num_row_groups)], dtype=np.int64)
        self.group_sizes = sizes
        self.group_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self._cache: collections.OrderedDict[int, list[dict[str, Any]]] = collections.OrderedDict()

    def __len__(self) -> int:
        return int(self.group_starts[-1])

    def where(self, i: int) -> str:
        return f"{self.path}:row {i + 1}"

    def _group(self, g: int) -> list[dict[str, Any]]:
        rows = self._cache.get(g)
        if rows is None:
            try:
                rows = self._pf.read_row_group(g, columns=self.columns).to_pylist()
            except Exception as e:
                raise DataError(f"{self.path}:row group {g}", f"cannot decode: {e}") from None
            self._cache[g] = rows
            while len(self._cache) > self._CACHE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(g)
        return rows

    def read(self, i: int) -> dict[str, Any] | None:
        g = int(np.searchsorted(self.group_starts, i, side="right") - 1)
        return self._group(g)[i - int(self.group_starts[g])]

    def close(self) -> None:
        self._cache.clear()


# --------------------------------------------------------------------------- fields


def as_messages(value: Any, where: str, key: str) -> PromptText:
    if isinstance(value, str):
        return value
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        for k, m in enumerate(value):
            if "role" not in m or "content" not in m:
                raise DataError(where, f"{key!r} message {k} needs 'role' and 'content', has {sorted(m)}")
        return value
    raise DataError(where, f"{key!r} must be a string or a non-empty list of {{role, content}} messages, "
                           f"got {type(value).__name__}")


def as_json_value(value: Any, where: str, key: str, kind: type) -> Any:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise DataError(where, f"{key!r} is a string but not valid JSON: {e.msg}") from None
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if not isinstance(value, kind):
        raise DataError(where, f"{key!r} must be a {kind.__name__} (or its JSON text), got {type(value).__name__}")
    return value



def validate_prompt_file(path: str | os.PathLike[str], input_key: str = "prompt", label_key: str | None = "label",
                         n_lines: int = 20, flag: str = "--prompt-data") -> int:
    """Pre-submit check: the file exists, its suffix is known, and the first `n_lines`
    records (of the @[START:END] slice, if any) parse and carry the keys. Returns how many
    records were checked."""
    spec = parse_prompt_spec(path, flag)
    p = spec.path
    check_exists(p, flag)
    if spec.sliced or p.is_dir():
        return _validate_records(spec, input_key, label_key, n_lines, flag)
    fmt = file_format(p)
    checked = 0
    if fmt == "jsonl":
        with open(p, "rb") as f:
            line_no = 0
            # bounded reads: a file that is one huge line is refused, not read whole into memory
            while checked < n_lines and (raw := f.readline(MAX_LINE_BYTES + 1)):
                line_no += 1
                where = f"{p}:{line_no}"
                if _too_long(raw):
                    raise DataError(where, _too_long_message(raw))
                if not raw.strip():
                    continue
                try:
                    obj = json.loads(raw.decode("utf-8-sig" if line_no == 1 else "utf-8"))
                except (UnicodeDecodeError, json.JSONDecodeError) as e:
                    hint = " (a JSON array file is not JSON Lines: write one object per line)" \
                        if raw.lstrip()[:1] == b"[" else ""
                    raise DataError(where, f"invalid JSON line: {e}{hint}") from None
                if not isinstance(obj, dict):
                    hint = " (a JSON array file is not JSON Lines: write one object per line)" \
                        if raw.lstrip()[:1] == b"[" else ""
                    raise DataError(where, f"expected a JSON object, got {type(obj).__name__}{hint}")
                _check_keys(obj, where, input_key, label_key)
                checked += 1
    else:
        records = ParquetRecords(p, *key_columns(input_key, label_key))
        for i in range(min(n_lines, len(records))):
            _check_keys(records.read(i) or {}, records.where(i), input_key, label_key)
            checked += 1
    if checked == 0:
        raise DataError(str(p), "prompt file has no records")
    return checked


# Submit counts the records of a JSON Lines file up to this size (a newline scan, ~1 s per GiB);
# a larger file is left to the driver, which records a shortfall when it happens.
COUNT_MAX_BYTES = 2 << 30


def count_records(path: str | os.PathLike[str], flag: str = "--prompt-data") -> int | None:
    """How many records the prompt spec serves per epoch (its @[START:END] slice applied), or None
    when the file is too large to count at submit."""
    spec = parse_prompt_spec(path, flag)
    if spec.path.is_dir():
        if data_dirs.dir_bytes(spec.path, flag) > COUNT_MAX_BYTES:
            return None
        records = open_records(spec.path, [], [], flag)
        n = len(records)
        records.close()
    elif file_format(spec.path) == "jsonl":
        if spec.path.stat().st_size > COUNT_MAX_BYTES:
            return None
        n = len(JsonlRecords._build_index(spec.path)[0])
    else:
        import pyarrow.parquet as pq

        n = pq.ParquetFile(spec.path).metadata.num_rows
    lo, hi = spec.bounds(n)
    return hi - lo


def _validate_records(spec: PromptSpec, input_key: str, label_key: str | None, n_lines: int, flag: str) -> int:
    """validate_prompt_file for a slice or a directory: the slice's bounds need the record count, so
    the data is indexed (one pass, as the driver does at start) and the first records read."""
    records = open_records(spec.path, *key_columns(input_key, label_key), flag)
    try:
        if len(records) == 0:
            raise DataError(str(spec.path), "prompt file has no records")
        lo, hi = spec.bounds(len(records))
        if lo == hi:
            raise ConfigError(f"{flag} {spec}: {empty_slice(len(records))}")
        checked = 0
        for i in range(lo, min(hi, lo + n_lines)):
            try:
                obj = records.read(i)
            except BadRecord as e:
                raise DataError(e.where, e.message) from None
            if obj is not None:
                _check_keys(obj, records.where(i), input_key, label_key)
                checked += 1
        return checked
    finally:
        records.close()


def empty_slice(n_records: int) -> str:
    return f"the slice selects no records (the file has {n_records}; a slice is PATH@[START:END] over its records)"


def _too_long(raw: bytes) -> bool:
    """`raw` came from readline(MAX_LINE_BYTES + 1): the line went on past the limit."""
    return len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n")


def _too_long_message(raw: bytes) -> str:
    hint = " (a JSON array file is not JSON Lines: write one object per line)" if raw.lstrip()[:1] == b"[" else \
        " (JSON Lines: one prompt record per line)"
    limit = f"{MAX_LINE_BYTES >> 20} MiB" if MAX_LINE_BYTES % (1 << 20) == 0 else f"{MAX_LINE_BYTES} bytes"
    return f"line is longer than {limit}{hint}"


def _check_keys(obj: Mapping[str, Any], where: str, input_key: str, label_key: str | None) -> None:
    if obj.get(input_key) is None:
        raise DataError(where, f"missing input key {input_key!r} (--input-key); record has {sorted(obj)}")
    as_messages(obj[input_key], where, input_key)
    if label_key is not None and obj.get(label_key) is None:
        raise DataError(where, f"missing label key {label_key!r} (--label-key); record has {sorted(obj)}")
