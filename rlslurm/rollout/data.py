"""Prompt data for the rollout driver: streamed records, a shuffled cursor, resumable state.

A prompt file can be far larger than memory, so records are never loaded whole:

- JSON Lines: one pass builds a compact index (the byte offset and line number of
  every non-empty line, two int64 numpy arrays); a record is read by seeking to its
  offset when it is served.
- Parquet: the row-group sizes come from the footer; a served record decodes its row
  group (only the columns we need), and the last decoded row groups are cached.
- A directory: its shards as one sequence, or a `datasets` save_to_disk directory
  (rlslurm/rollout/data_dirs.py).

The readers and the checks of a record are rlslurm/rollout/prompt_records.py.

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
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from rlslurm.errors import ConfigError, DataError
from rlslurm.plugins import load_object
from rlslurm.rollout.prompt_records import (
    BadRecord,
    ParquetRecords,
    PromptText,
    as_json_value,
    as_messages,
    check_exists,
    empty_slice,
    file_format,
    fingerprint,
    key_columns,
    open_records,
)
from rlslurm.settings.prompt_slice import PromptSpec, parse_prompt_spec

log = logging.getLogger(__name__)

CURSOR_VERSION = 1
_MAX_LENIENT_WARNINGS = 10


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
        check_exists(self.path, flag)
        if self.path.is_file():
            file_format(self.path)  # an unknown suffix is refused before anything else
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

        columns, required = key_columns(input_key, label_key, metadata_key, tool_key)
        self._records = open_records(self.path, columns, required, flag)
        self.file_records = len(self._records)
        if self.file_records == 0:
            raise DataError(str(self.path), "prompt file has no records")
        self.fingerprint = fingerprint(self.path, self.file_records, flag)
        # the records served: [lo, hi) of the file; record numbers (Prompt.index) stay the file's
        self._lo, self._hi = self.spec.bounds(self.file_records)
        self.num_records = self._hi - self._lo
        if self.num_records == 0:
            raise ConfigError(f"{flag} {self.spec}: {empty_slice(self.file_records)}")

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
            if isinstance(self._records, ParquetRecords) and len(self._records.group_sizes) > 1:
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
        except BadRecord as e:
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
        prompt = as_messages(value, where, self.input_key)
        label = None
        if self.label_key is not None:
            label = obj.get(self.label_key)
            if label is None:
                raise DataError(where, f"missing label key {self.label_key!r} (--label-key); record has {sorted(obj)}")
        metadata: dict[str, Any] = {}
        if self.metadata_key is not None and obj.get(self.metadata_key) is not None:
            metadata = as_json_value(obj[self.metadata_key], where, self.metadata_key, dict)
        tools = None
        if self.tool_key is not None and obj.get(self.tool_key) is not None:
            tools = as_json_value(obj[self.tool_key], where, self.tool_key, list)

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
            "fingerprint": dict(self.fingerprint),
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
        if state.get("fingerprint") != self.fingerprint:
            raise DataError(
                str(self.path),
                f"the prompt file is not the one the run started with (saved {state.get('fingerprint')}, "
                f"now {self.fingerprint}); resuming would skip or repeat prompts",
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
