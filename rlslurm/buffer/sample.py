"""What a rollout carries to the trainer.

Per-token fields are numpy arrays (not lists): a 256 x 4096-token rollout is ~10 MB of
tokens, logprobs and masks, and arrays let the codec write and read them without
per-element Python work. Everything else is JSON-able.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from rlslurm.errors import DataError

TOKEN_DTYPE = np.int32
LOGPROB_DTYPE = np.float32
MASK_DTYPE = np.uint8

RolloutKind = Literal["train", "eval"]


class SampleStatus(str, enum.Enum):
    COMPLETED = "completed"  # the model stopped on its own (EOS / stop string)
    TRUNCATED = "truncated"  # hit max_new_tokens or the context length
    ABORTED = "aborted"  # generation was aborted (weight update, preempt)
    FAILED = "failed"  # the engine or the reward function failed


@dataclass
class Sample:
    """One prompt + response, as slime's Sample carries it to training.

    `loss_mask` has one entry per response token; 0 marks tokens that are not trained
    (tool outputs and environment turns in multi-turn rollouts). `reward` is a float or
    a dict of named rewards, with `reward_key` naming the one that is trained on.
    """

    prompt_tokens: np.ndarray
    response_tokens: np.ndarray
    reward: float | dict[str, float] = 0.0
    reward_key: str | None = None
    loss_mask: np.ndarray | None = None  # None means every response token is trained
    rollout_logprobs: np.ndarray | None = None  # engine logprob of each response token
    status: SampleStatus = SampleStatus.COMPLETED
    group_index: int = 0  # which prompt group (GRPO normalises rewards within a group)
    index: int = 0  # position of the sample in the rollout
    weight_version: int = 0  # weights that generated it (oldest one, for partial rollouts)
    label: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.prompt_tokens = np.ascontiguousarray(self.prompt_tokens, dtype=TOKEN_DTYPE).reshape(-1)
        self.response_tokens = np.ascontiguousarray(self.response_tokens, dtype=TOKEN_DTYPE).reshape(-1)
        if self.loss_mask is not None:
            self.loss_mask = np.ascontiguousarray(self.loss_mask, dtype=MASK_DTYPE).reshape(-1)
        if self.rollout_logprobs is not None:
            self.rollout_logprobs = np.ascontiguousarray(self.rollout_logprobs, dtype=LOGPROB_DTYPE).reshape(-1)
        self.status = SampleStatus(self.status)

    @classmethod
    def trusted(cls, **fields: Any) -> "Sample":
        """Build from fields that already have the right types and dtypes (the codec's
        output after checksum verification), skipping __post_init__'s conversions:
        at 256+ samples per rollout that is a measurable share of a read."""
        obj = cls.__new__(cls)
        obj.__dict__.update(fields)
        return obj

    @property
    def response_length(self) -> int:
        return int(self.response_tokens.shape[0])

    @property
    def tokens(self) -> np.ndarray:
        return np.concatenate([self.prompt_tokens, self.response_tokens])

    @property
    def scalar_reward(self) -> float:
        """The reward that is trained on."""
        return self._scalar_reward(f"sample {self.index}")

    def _scalar_reward(self, where: str) -> float:
        if isinstance(self.reward, dict):
            if self.reward_key is None:
                raise DataError(where, f"reward is a dict {sorted(self.reward)} but reward_key is not set")
            if self.reward_key not in self.reward:
                raise DataError(where, f"reward_key {self.reward_key!r} not in reward keys {sorted(self.reward)}")
            return float(self.reward[self.reward_key])
        return float(self.reward)

    def effective_loss_mask(self) -> np.ndarray:
        if self.loss_mask is None:
            return np.ones(self.response_length, dtype=MASK_DTYPE)
        return self.loss_mask

    def validate(self, where: str) -> None:
        """Raise DataError naming `where` (e.g. 'rollout 3 sample 17') on any inconsistency."""
        n = self.response_length
        if self.loss_mask is not None and self.loss_mask.shape[0] != n:
            raise DataError(where, f"loss_mask has {self.loss_mask.shape[0]} entries but the response has {n} tokens")
        if self.loss_mask is not None and n and self.loss_mask.max(initial=0) > 1:
            raise DataError(where, "loss_mask must contain only 0 and 1")
        if self.rollout_logprobs is not None and self.rollout_logprobs.shape[0] != n:
            raise DataError(
                where, f"rollout_logprobs has {self.rollout_logprobs.shape[0]} entries but the response has {n} tokens"
            )
        if isinstance(self.reward, dict):
            for k, v in self.reward.items():
                if not isinstance(k, str) or not isinstance(v, (int, float)) or isinstance(v, bool):
                    raise DataError(where, f"reward dict entries must be str -> number, got {k!r}: {v!r}")
            self._scalar_reward(where)  # raises if reward_key is wrong
        elif not isinstance(self.reward, (int, float)) or isinstance(self.reward, bool):
            raise DataError(where, f"reward must be a number or a dict of numbers, got {type(self.reward).__name__}")
        if not math.isfinite(self._scalar_reward(where)):
            raise DataError(where, f"reward is {self._scalar_reward(where)}")
        if not isinstance(self.metadata, dict):
            raise DataError(where, f"metadata must be a dict, got {type(self.metadata).__name__}")


@dataclass
class RolloutMeta:
    """Everything about a rollout that is not a sample.

    `data_cursor` is the prompt-data position *after* this rollout (opaque to the
    buffer): a restarted driver continues from the cursor of the last committed rollout,
    so a prompt is neither skipped nor generated twice.
    """

    kind: RolloutKind = "train"
    weight_versions: list[int] = field(default_factory=list)
    data_cursor: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self, where: str) -> None:
        if self.kind not in ("train", "eval"):
            raise DataError(where, f"kind must be 'train' or 'eval', got {self.kind!r}")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in self.weight_versions):
            raise DataError(where, f"weight_versions must be integers, got {self.weight_versions!r}")
        for k, v in self.metrics.items():
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise DataError(where, f"metric {k!r} must be a finite number, got {v!r}")
        try:
            json.dumps(self.to_json(), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise DataError(where, f"data_cursor/extra must be JSON-serialisable: {e}") from e

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "weight_versions": list(self.weight_versions),
            "data_cursor": self.data_cursor,
            "metrics": self.metrics,
            "extra": self.extra,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "RolloutMeta":
        return cls(
            kind=obj.get("kind", "train"),
            weight_versions=list(obj.get("weight_versions", [])),
            data_cursor=dict(obj.get("data_cursor", {})),
            metrics=dict(obj.get("metrics", {})),
            extra=dict(obj.get("extra", {})),
        )


@dataclass
class RolloutStats:
    """Summary kept in the manifest so `buffer ls` need not read sample data."""

    n_samples: int
    n_groups: int
    reward_mean: float
    reward_std: float
    truncation_rate: float
    status_counts: dict[str, int]
    response_tokens: int
    weight_versions: list[int]

    @classmethod
    def of(cls, samples: list[Sample]) -> "RolloutStats":
        rewards = np.array([s.scalar_reward for s in samples], dtype=np.float64)
        counts: dict[str, int] = {}
        for s in samples:
            counts[s.status.value] = counts.get(s.status.value, 0) + 1
        n = len(samples)
        return cls(
            n_samples=n,
            n_groups=len({s.group_index for s in samples}),
            reward_mean=float(rewards.mean()) if n else 0.0,
            reward_std=float(rewards.std()) if n else 0.0,
            truncation_rate=counts.get(SampleStatus.TRUNCATED.value, 0) / n if n else 0.0,
            status_counts=counts,
            response_tokens=int(sum(s.response_length for s in samples)),
            weight_versions=sorted({s.weight_version for s in samples}),
        )

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "RolloutStats":
        return cls(**{k: obj[k] for k in cls.__dataclass_fields__})


@dataclass
class Rollout:
    """A committed rollout as the trainer reads it. Sample arrays are read-only views
    into one buffer read from disk."""

    rollout_id: int
    samples: list[Sample]
    meta: RolloutMeta
    stats: RolloutStats
    committed_at: float = 0.0

    def __len__(self) -> int:
        return len(self.samples)
