"""Prompt data for the rollout driver: streamed records, a shuffled cursor, resumable state.

A prompt file can be far larger than memory, so records are never loaded whole:

- JSON Lines: one pass builds a compact index (the byte offset and line number of
  every non-empty line, two int64 numpy arrays); a record is read by seeking to its
  offset when it is served.
- Parquet: the row-group sizes come from the footer; a served record decodes its row
  group (only the columns we need), and the last decoded row groups are cached.
- A directory: its shards as one sequence, or a `datasets` save_to_disk directory
  (rlslurm/rollout/data_dirs.py).

Shuffling permutes record numbers with a generator seeded by (seed, epoch), so the
order of any epoch can be recomputed from three integers. For parquet the permutation
is two-level (row groups in random order, rows shuffled inside each group) so that
consecutive prompts come from one decoded row group instead of one row group each.

The cursor (`state_dict`) is the epoch, the position in that epoch's permutation,
counters, and the prompts that were handed back unfinished (`push_back`, partial
rollouts). Restoring it serves exactly the prompts not consumed yet: pending ones
first, then the permutation from the saved position.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from rlslurm.errors import ConfigError, DataError
from rlslurm.plugins import load_object
from rlslurm.rollout import data_dirs
from rlslurm.settings.prompt_slice import PromptSpec, parse_prompt_spec

log = logging.getLogger(__name__)

CURSOR_VERSION = 1
JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
_INDEX_CHUNK = 16 << 20
# One record (line) of a JSON Lines prompt file is read whole; past this it is refused instead. A
# prompt fits a model's context (128k tokens are < 1 MiB of text, an inline base64 image a few MiB):
# a longer line is a file that is not JSON Lines (one JSON array, no newlines), read whole otherwise.
MAX_LINE_BYTES = 64 << 20
_FINGERPRINT_BYTES = 64 << 10
_MAX_LENIENT_WARNINGS = 10

PromptText = str | list[dict[str, Any]]


# --------------------------------------------------------------------------- prompts


@dataclass
class PartialSample:
    """What one sample of an unfinished group had generated when it was aborted.

    Re-served with its prompt so generation continues where it stopped (partial
    rollout). `weight_version` is the oldest weights that produced any of its tokens;
    `version_runs` ([count, version] runs over the tokens, -1 for tokens the model did
    not generate) says which weights produced which segment. None (cursors written
    before segments were recorded, or a generate function that did not keep them):
    every token is taken to come from `weight_version`.
    """

    output_ids: list[int]
    output_logprobs: list[float]
    loss_mask: list[int]
    weight_version: int
    status: str = "aborted"
    version_runs: list[list[int]] | None = None

    def __post_init__(self) -> None:
        n = len(self.output_ids)
        if len(self.output_logprobs) != n or len(self.loss_mask) != n:
            raise DataError(
                "partial sample",
                f"{n} output ids but {len(self.output_logprobs)} logprobs and {len(self.loss_mask)} mask entries",
            )
        if self.version_runs is not None:
            self.version_runs = [[int(c), int(v)] for c, v in self.version_runs]
            if any(c <= 0 for c, _ in self.version_runs) or sum(c for c, _ in self.version_runs) != n:
                raise DataError("partial sample", f"version_runs {self.version_runs} do not cover its {n} tokens")

    def runs(self) -> list[list[int]]:
        if self.version_runs is not None:
            return [list(r) for r in self.version_runs]
        return [[len(self.output_ids), int(self.weight_version)]] if self.output_ids else []

    def to_json(self) -> dict[str, Any]:
        return {
            "output_ids": [int(t) for t in self.output_ids],
            "output_logprobs": [float(x) for x in self.output_logprobs],
            "loss_mask": [int(m) for m in self.loss_mask],
            "weight_version": int(self.weight_version),
            "status": self.status,
            "version_runs": self.version_runs,
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> "PartialSample":
        return cls(
            output_ids=list(obj["output_ids"]),
            output_logprobs=list(obj["output_logprobs"]),
            loss_mask=list(obj["loss_mask"]),
            weight_version=int(obj["weight_version"]),
            status=str(obj.get("status", "aborted")),
            version_runs=obj.get("version_runs"),
        )


@dataclass
class Prompt:
    """One prompt as the driver generates from it.

    `index` is the record number in the file (stable across epochs and restarts),
    `where` is 'path:line' (or 'path:row N') for messages. With the chat template on,
    `prompt` is the templated text and `messages` the conversation it came from.
    `partial` is set when an unfinished group was handed back: one entry per sample.
    """

    index: int
    epoch: int
    prompt: PromptText
    prompt_ids: list[int] | None
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    tools: list[Any] | None = None
    messages: list[dict[str, Any]] | None = None
    where: str = ""
    partial: list[PartialSample] | None = None

    @property
    def uid(self) -> tuple[int, int]:
        """Identity of a served prompt: the same record in another epoch is another prompt."""
        return (self.epoch, self.index)

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "epoch": self.epoch,
            "prompt": self.prompt,
            "prompt_ids": self.prompt_ids,
            "label": self.label,
            "metadata": self.metadata,
            "tools": self.tools,
            "messages": self.messages,
            "where": self.where,
            "partial": None if self.partial is None else [p.to_json() for p in self.partial],
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> "Prompt":
        partial = obj.get("partial")
        return cls(
            index=int(obj["index"]),
            epoch=int(obj["epoch"]),
            prompt=obj["prompt"],
            prompt_ids=None if obj.get("prompt_ids") is None else [int(t) for t in obj["prompt_ids"]],
            label=obj.get("label"),
            metadata=dict(obj.get("metadata") or {}),
            tools=obj.get("tools"),
            messages=obj.get("messages"),
            where=str(obj.get("where", "")),
            partial=None if partial is None else [PartialSample.from_json(p) for p in partial],
        )


BufferFilter = Callable[[list[Prompt], int], list[Prompt]]


def pop_first(pending: list[Prompt], n: int) -> list[Prompt]:
    """Default buffer filter: re-serve handed-back prompts oldest first."""
    return pending[:n]


@runtime_checkable
class DataSource(Protocol):
    """What the driver needs from a prompt source (PromptSource or a --data-source-path class)."""

    def take(self, n: int) -> list[Prompt]: ...

    def push_back(self, prompt: Prompt, partial: list[PartialSample] | None = None) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


# --------------------------------------------------------------------------- records


class _BadRecord(Exception):
    """A record that cannot be parsed (strict: DataError; lenient: counted and skipped)."""

    def __init__(self, where: str, message: str):
        self.where = where
        self.message = message
        super().__init__(f"{where}: {message}")


def _file_format(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    raise DataError(str(path), f"unsupported prompt file type {suffix or '(no suffix)'!r}; use .jsonl or .parquet")


def _check_exists(path: Path, flag: str = "--prompt-data") -> None:
    if not path.exists():
        raise DataError(str(path), f"prompt file does not exist{data_dirs.missing_path_hint(path, flag)}")
    if not path.is_file() and not path.is_dir():
        raise DataError(str(path), "prompt data path is not a file or a directory")


def _file_digest(path: Path) -> dict[str, Any]:
    h = hashlib.sha1()
    with open(path, "rb") as f:
        h.update(f.read(_FINGERPRINT_BYTES))
    return {"size": path.stat().st_size, "head_sha1": h.hexdigest()}


def _fingerprint(path: Path, n_records: int, flag: str = "--prompt-data") -> dict[str, Any]:
    """Cheap identity of the data: a cursor into another file (or other shards) is meaningless."""
    if path.is_dir():
        return {"records": int(n_records), "shards": data_dirs.dir_digest(path, flag, _file_digest)}
    digest = _file_digest(path)
    return {"size": digest["size"], "records": int(n_records), "head_sha1": digest["head_sha1"]}


def _open_records(path: Path, columns: Sequence[str], required: Sequence[tuple[str, str]],
                  flag: str = "--prompt-data") -> "_JsonlRecords | _ParquetRecords | data_dirs.ShardedRecords":
    """A reader of the records at `path`: a .jsonl/.parquet file, or a directory (data_dirs)."""
    def open_file(p: Path) -> _JsonlRecords | _ParquetRecords:
        return _JsonlRecords(p) if _file_format(p) == "jsonl" else _ParquetRecords(p, columns, required)

    return data_dirs.open_dir(path, open_file, columns, required, flag) if path.is_dir() else open_file(path)


def _key_columns(input_key: str, label_key: str | None, *more: str | None) -> tuple[list[str], list[tuple[str, str]]]:
    """The columns a columnar reader decodes, and those a record must have (with their flags)."""
    required = [(input_key, "--input-key")] + ([(label_key, "--label-key")] if label_key else [])
    return [c for c in (input_key, label_key, *more) if c], required


class _JsonlRecords:
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
        """The record's object, None for a whitespace-only line; _BadRecord if unparseable."""
        offset = int(self.offsets[i])
        self._fh.seek(offset)
        raw = self._fh.readline(MAX_LINE_BYTES + 1)
        where = self.where(i)
        if _too_long(raw):
            raise _BadRecord(where, _too_long_message(raw))
        try:
            # editors on Windows start files with a byte-order mark; json.loads rejects it
            text = raw.decode("utf-8-sig" if offset == 0 else "utf-8")
        except UnicodeDecodeError as e:
            raise _BadRecord(where, f"not valid UTF-8 ({e.reason} at byte {e.start})") from None
        if not text.strip():
            return None
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise _BadRecord(where, f"invalid JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(obj, dict):
            hint = ""
            if text.lstrip()[:1] == "[":
                hint = " (a JSON array file is not JSON Lines: write one object per line)"
            raise _BadRecord(where, f"expected a JSON object, got {type(obj).__name__}{hint}")
        return obj

    def close(self) -> None:
        self._fh.close()


class _ParquetRecords:
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


def _as_messages(value: Any, where: str, key: str) -> PromptText:
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


def _as_json_value(value: Any, where: str, key: str, kind: type) -> Any:
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


def _load_tokenizer(tokenizer: Any) -> Any:
    if tokenizer is None or not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(tokenizer))
    except Exception as e:
        raise ConfigError(f"--hf-checkpoint {tokenizer}: cannot load its tokenizer: {e}") from None


# --------------------------------------------------------------------------- the source


class PromptSource:
    """Streams prompts from a .jsonl or .parquet file in a resumable, seeded order.

    `take(n)` serves up to n prompts (fewer only once every epoch is used up; with
    `num_epochs=None` epochs never run out, as slime's data source wraps to the next epoch);
    `push_back` returns an unfinished prompt so it is served again before new ones;
    `state_dict`/`load_state_dict` save and restore the cursor.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        input_key: str = "prompt",
        label_key: str | None = "label",
        metadata_key: str | None = None,
        tool_key: str | None = None,
        tokenizer: Any = None,
        apply_chat_template: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        max_prompt_len: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        num_epochs: int | None = 1,
        strict: bool = True,
        buffer_filter: BufferFilter | str | None = None,
        flag: str = "--prompt-data",
    ):
        # `path` may carry slime's @[START:END] slice (rlslurm/settings/prompt_slice.py)
        self.spec: PromptSpec = parse_prompt_spec(path, flag)
        self.path = self.spec.path
        _check_exists(self.path, flag)
        if self.path.is_file():
            _file_format(self.path)  # an unknown suffix is refused before anything else
        if num_epochs is not None and num_epochs < 1:
            raise ConfigError(f"--num-epoch must be >= 1, got {num_epochs}")
        if max_prompt_len is not None and max_prompt_len < 1:
            raise ConfigError(f"--max-prompt-len must be >= 1, got {max_prompt_len}")
        self.tokenizer = _load_tokenizer(tokenizer)
        if apply_chat_template and self.tokenizer is None:
            raise ConfigError("--apply-chat-template needs a tokenizer (--hf-checkpoint)")
        if max_prompt_len is not None and self.tokenizer is None:
            raise ConfigError("--max-prompt-len needs a tokenizer (--hf-checkpoint) to count prompt tokens")
        self.input_key = input_key
        self.label_key = label_key
        self.metadata_key = metadata_key
        self.tool_key = tool_key
        self.apply_chat_template = apply_chat_template
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.max_prompt_len = max_prompt_len
        self.shuffle = shuffle
        self.seed = int(seed)
        self.num_epochs = None if num_epochs is None else int(num_epochs)
        self.strict = strict
        if isinstance(buffer_filter, str):
            buffer_filter = load_object(buffer_filter, what="--buffer-filter-path")
        self.buffer_filter: BufferFilter = buffer_filter or pop_first

        columns, required = _key_columns(input_key, label_key, metadata_key, tool_key)
        self._records = _open_records(self.path, columns, required, flag)
        self.file_records = len(self._records)
        if self.file_records == 0:
            raise DataError(str(self.path), "prompt file has no records")
        self._fingerprint = _fingerprint(self.path, self.file_records, flag)
        # the records served: [lo, hi) of the file; record numbers (Prompt.index) stay the file's
        self._lo, self._hi = self.spec.bounds(self.file_records)
        self.num_records = self._hi - self._lo
        if self.num_records == 0:
            raise ConfigError(f"{flag} {self.spec}: {_empty_slice(self.file_records)}")

        self.epoch = 0
        self.position = 0
        # prompts served in this epoch so far: without an epoch cap, an epoch that serves none (every
        # record filtered by --max-prompt-len) ends the data instead of cycling forever
        self._epoch_served = 0
        self.counters: dict[str, int] = collections.Counter()
        self._pending: list[Prompt] = []
        self._order_cache: tuple[int, np.ndarray] | None = None

    # ---- order

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Record numbers in the order epoch `epoch` serves them."""
        if self._order_cache is not None and self._order_cache[0] == epoch:
            return self._order_cache[1]
        n, lo, hi = self.num_records, self._lo, self._hi
        if not self.shuffle:
            order = np.arange(lo, hi, dtype=np.int64)
        else:
            rng = np.random.default_rng([self.seed, epoch])
            if isinstance(self._records, _ParquetRecords) and len(self._records.group_sizes) > 1:
                # each row group clipped to the slice (empty ones kept: the draws of an unsliced file
                # must not change, or a resumed cursor would point into another order)
                g0 = np.clip(self._records.group_starts[:-1], lo, hi)
                sizes = np.clip(self._records.group_starts[1:], lo, hi) - g0
                order = np.concatenate(
                    [g0[g] + rng.permutation(int(sizes[g])) for g in rng.permutation(len(sizes))]
                ).astype(np.int64)
            else:
                order = lo + rng.permutation(n).astype(np.int64)
        self._order_cache = (epoch, order)
        return order

    # ---- serving

    @property
    def exhausted(self) -> bool:
        return not self._pending and not self._epochs_left()

    def _epochs_left(self) -> bool:
        return self.num_epochs is None or self.epoch < self.num_epochs

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def take(self, n: int) -> list[Prompt]:
        out = self._take_pending(n)
        while len(out) < n:
            p = self._next_new()
            if p is None:
                break
            out.append(p)
        return out

    def __iter__(self) -> Iterator[Prompt]:
        while batch := self.take(1):
            yield batch[0]

    def push_back(self, prompt: Prompt, partial: list[PartialSample] | None = None) -> None:
        """Hand an unfinished prompt back; it is served again before any new prompt."""
        if partial is not None:
            prompt.partial = list(partial)
        self._pending.append(prompt)
        self.counters["pushed_back"] += 1

    def _take_pending(self, n: int) -> list[Prompt]:
        if not self._pending or n <= 0:
            return []
        chosen = list(self.buffer_filter(list(self._pending), n))
        if len(chosen) > n:
            raise ConfigError(f"--buffer-filter-path returned {len(chosen)} prompts when asked for {n}")
        ids = {id(p) for p in self._pending}
        if any(id(p) not in ids for p in chosen) or len({id(p) for p in chosen}) != len(chosen):
            raise ConfigError("--buffer-filter-path must return distinct prompts taken from the pending list")
        taken = {id(p) for p in chosen}
        self._pending = [p for p in self._pending if id(p) not in taken]
        return chosen

    def _next_new(self) -> Prompt | None:
        while self._epochs_left():
            if self.position >= self.num_records:
                if self.num_epochs is None and self._epoch_served == 0:
                    return None  # a whole epoch served nothing: so would every later one
                self.epoch += 1
                self.position = 0
                self._epoch_served = 0
                continue
            # each epoch's order is a function of (--rollout-seed, epoch) alone (epoch_order), so the
            # cursor (epoch, position) resumes mid-epoch exactly, whatever the number of epochs
            record = int(self.epoch_order(self.epoch)[self.position])
            prompt = self._build(record, self.epoch)
            # Advance only after the record was handled: a strict error leaves the
            # cursor on the bad record, so a fixed file resumes exactly there.
            self.position += 1
            if prompt is not None:
                self.counters["served"] += 1
                self._epoch_served += 1
                return prompt
        return None

    def _build(self, record: int, epoch: int) -> Prompt | None:
        where = self._records.where(record)
        try:
            obj = self._records.read(record)
        except _BadRecord as e:
            if self.strict:
                raise DataError(e.where, f"{e.message} (--no-data-strict counts and skips bad lines)") from None
            self.counters["malformed"] += 1
            if self.counters["malformed"] <= _MAX_LENIENT_WARNINGS:
                log.warning("skipping malformed record %s: %s", e.where, e.message)
            return None
        if obj is None:
            self.counters["blank"] += 1
            return None
        # Missing keys are errors even in lenient mode: they mean a wrong --input-key or
        # --label-key far more often than a torn line, and skipping would drop everything.
        value = obj.get(self.input_key)
        if value is None:
            raise DataError(where, f"missing input key {self.input_key!r} (--input-key); record has {sorted(obj)}")
        prompt = _as_messages(value, where, self.input_key)
        label = None
        if self.label_key is not None:
            label = obj.get(self.label_key)
            if label is None:
                raise DataError(where, f"missing label key {self.label_key!r} (--label-key); record has {sorted(obj)}")
        metadata: dict[str, Any] = {}
        if self.metadata_key is not None and obj.get(self.metadata_key) is not None:
            metadata = _as_json_value(obj[self.metadata_key], where, self.metadata_key, dict)
        tools = None
        if self.tool_key is not None and obj.get(self.tool_key) is not None:
            tools = _as_json_value(obj[self.tool_key], where, self.tool_key, list)

        messages = None
        prompt_ids = None
        if self.apply_chat_template:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            try:
                prompt = self.tokenizer.apply_chat_template(
                    messages, tools=tools, tokenize=False, add_generation_prompt=True, **self.chat_template_kwargs
                )
            except Exception as e:
                raise DataError(where, f"chat template failed: {type(e).__name__}: {e}") from None
        if isinstance(prompt, str) and self.tokenizer is not None:
            prompt_ids = list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        if self.max_prompt_len is not None:
            if prompt_ids is None:
                raise DataError(where, "prompt is a message list: its length cannot be checked against "
                                       "--max-prompt-len without --apply-chat-template")
            if len(prompt_ids) > self.max_prompt_len:
                self.counters["filtered_long"] += 1
                return None
        return Prompt(index=record, epoch=epoch, prompt=prompt, prompt_ids=prompt_ids, label=label,
                      metadata=metadata, tools=tools, messages=messages, where=where)

    # ---- cursor

    def state_dict(self) -> dict[str, Any]:
        """The cursor, JSON-able: stored with each committed rollout."""
        return {
            "version": CURSOR_VERSION,
            "path": str(self.path),
            "fingerprint": dict(self._fingerprint),
            "shuffle": self.shuffle,
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
            "counters": dict(self.counters),
            "pending": [p.to_json() for p in self._pending],
            **({"slice": [self._lo, self._hi]} if self.spec.sliced else {}),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        where = f"data cursor for {self.path}"
        if state.get("version") != CURSOR_VERSION:
            raise DataError(where, f"cursor version {state.get('version')!r}, this code reads {CURSOR_VERSION}")
        if state.get("fingerprint") != self._fingerprint:
            raise DataError(
                str(self.path),
                f"the prompt file is not the one the run started with (saved {state.get('fingerprint')}, "
                f"now {self._fingerprint}); resuming would skip or repeat prompts",
            )
        if bool(state.get("shuffle")) != self.shuffle or int(state.get("seed", -1)) != self.seed:
            raise ConfigError(
                f"--rollout-shuffle/--rollout-seed changed since the cursor was saved (saved shuffle="
                f"{state.get('shuffle')} seed={state.get('seed')}, now shuffle={self.shuffle} seed={self.seed}); "
                "the data order would change and prompts would be skipped or repeated"
            )
        saved = state.get("slice") or [0, self.file_records]
        if list(saved) != [self._lo, self._hi]:
            raise ConfigError(
                f"--prompt-data {self.spec}: serves records [{self._lo}, {self._hi}) of the file but the cursor was "
                f"saved for records [{saved[0]}, {saved[1]}); resuming would skip or repeat prompts"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if position < 0 or position > self.num_records or epoch < 0:
            raise DataError(where, f"epoch {epoch} position {position} out of range ({self.num_records} records)")
        self.epoch, self.position = epoch, position
        self._epoch_served = position  # at most: what matters is only whether an epoch served none
        self.counters = collections.Counter({k: int(v) for k, v in state.get("counters", {}).items()})
        self._pending = [Prompt.from_json(p) for p in state.get("pending", [])]

    def metrics(self) -> dict[str, float]:
        out = {f"data/{k}": float(v) for k, v in sorted(self.counters.items())}
        out["data/epoch"] = float(self.epoch)
        out["data/pending"] = float(len(self._pending))
        return out

    def close(self) -> None:
        self._records.close()


# --------------------------------------------------------------------------- helpers


def validate_prompt_file(path: str | os.PathLike[str], input_key: str = "prompt", label_key: str | None = "label",
                         n_lines: int = 20, flag: str = "--prompt-data") -> int:
    """Pre-submit check: the file exists, its suffix is known, and the first `n_lines`
    records (of the @[START:END] slice, if any) parse and carry the keys. Returns how many
    records were checked."""
    spec = parse_prompt_spec(path, flag)
    p = spec.path
    _check_exists(p, flag)
    if spec.sliced or p.is_dir():
        return _validate_records(spec, input_key, label_key, n_lines, flag)
    fmt = _file_format(p)
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
        records = _ParquetRecords(p, *_key_columns(input_key, label_key))
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
        records = _open_records(spec.path, [], [], flag)
        n = len(records)
        records.close()
    elif _file_format(spec.path) == "jsonl":
        if spec.path.stat().st_size > COUNT_MAX_BYTES:
            return None
        n = len(_JsonlRecords._build_index(spec.path)[0])
    else:
        import pyarrow.parquet as pq

        n = pq.ParquetFile(spec.path).metadata.num_rows
    lo, hi = spec.bounds(n)
    return hi - lo


def _validate_records(spec: PromptSpec, input_key: str, label_key: str | None, n_lines: int, flag: str) -> int:
    """validate_prompt_file for a slice or a directory: the slice's bounds need the record count, so
    the data is indexed (one pass, as the driver does at start) and the first records read."""
    records = _open_records(spec.path, *_key_columns(input_key, label_key), flag)
    try:
        if len(records) == 0:
            raise DataError(str(spec.path), "prompt file has no records")
        lo, hi = spec.bounds(len(records))
        if lo == hi:
            raise ConfigError(f"{flag} {spec}: {_empty_slice(len(records))}")
        checked = 0
        for i in range(lo, min(hi, lo + n_lines)):
            try:
                obj = records.read(i)
            except _BadRecord as e:
                raise DataError(e.where, e.message) from None
            if obj is not None:
                _check_keys(obj, records.where(i), input_key, label_key)
                checked += 1
        return checked
    finally:
        records.close()


def _empty_slice(n_records: int) -> str:
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
    _as_messages(obj[input_key], where, input_key)
    if label_key is not None and obj.get(label_key) is None:
        raise DataError(where, f"missing label key {label_key!r} (--label-key); record has {sorted(obj)}")


_SOURCE_METHODS = ("take", "push_back", "state_dict", "load_state_dict")


def load_custom_source(spec: str, **kwargs: Any) -> DataSource:
    """Build the --data-source-path object: a class (called with kwargs) or a factory function."""
    factory = load_object(spec, what="--data-source-path")
    if not callable(factory):
        raise ConfigError(f"--data-source-path {spec!r}: {type(factory).__name__} is not a class or factory")
    try:
        source = factory(**kwargs)
    except TypeError as e:
        raise ConfigError(f"--data-source-path {spec!r}: cannot construct it: {e}") from None
    missing = [m for m in _SOURCE_METHODS if not callable(getattr(source, m, None))]
    if missing:
        raise ConfigError(f"--data-source-path {spec!r}: {type(source).__name__} lacks {', '.join(missing)} "
                          f"(a data source needs {', '.join(_SOURCE_METHODS)})")
    return source
