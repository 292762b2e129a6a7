"""Group filters and the collector that fills a rollout batch with groups that pass them.

Dynamic sampling (DAPO): a group whose rewards are all equal has zero advantage under
GRPO and teaches nothing, so it is dropped, and more prompts are drawn until
`rollout_batch_size` groups are kept. Prompts are drawn `over_sampling_batch_size` at
a time so that generation runs ahead of filtering.

When the batch is full, groups still generating are aborted and handed back to the
prompt source (with their tokens so far when partial rollout is on), so the data
cursor saved with the rollout never skips a prompt that was drawn but not used.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlslurm.buffer.sample import MASK_DTYPE, Sample, SampleStatus
from rlslurm.errors import ConfigError, UserError
from rlslurm.plugins import load_callable
from rlslurm.rollout.data import DataSource, PartialSample, Prompt
from rlslurm.rollout.generate_api import META_RUNS

log = logging.getLogger(__name__)

ZERO_STD_EPS = 1e-6


@dataclass
class FilterResult:
    keep: bool
    reason: str | None = None  # the metric a drop is counted under


GroupFilter = Callable[[list[Sample]], "bool | FilterResult"]
GroupRunner = Callable[[Prompt], Awaitable[list[Sample]]]


def _reward_std(group: Sequence[Sample]) -> float:
    rewards = [s.scalar_reward for s in group]
    mean = sum(rewards) / len(rewards)
    return math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))


def dynamic_sampling_zero_std(group: Sequence[Sample]) -> bool:
    """Keep a group only if its rewards differ (a group of one sample never does)."""
    return bool(group) and _reward_std(group) > ZERO_STD_EPS


def zero_std_filter(group: list[Sample]) -> FilterResult:
    """`dynamic_sampling_zero_std` with the reason split by the common reward value, so
    the metrics tell all-solved (`zero_std_1`) from all-failed (`zero_std_0`) prompts."""
    if dynamic_sampling_zero_std(group):
        return FilterResult(True)
    value = group[0].scalar_reward if group else 0.0
    return FilterResult(False, f"zero_std_{value:g}")


def load_filter(spec: str, *, what: str = "--dynamic-sampling-filter-path") -> GroupFilter:
    return load_callable(spec, what=what, min_args=1)


SampleFilter = Callable[[list[Sample]], Sequence[bool]]


def load_sample_filter(spec: str) -> SampleFilter:
    return load_callable(spec, what="--rollout-sample-filter-path", min_args=1)


def apply_sample_filter(fn: SampleFilter, spec: str, samples: list[Sample]) -> int:
    """--rollout-sample-filter-path (slime's name and place: after the rollout is filled, before it
    is stored): `fn(samples)` returns one bool per sample, False = not trained on. Such a sample
    keeps its place in its group (and in the group's reward baseline) and gets an all-zero loss
    mask, which the buffer stores. Returns how many were removed."""
    keep = fn(samples)
    try:
        keep = list(keep)
    except TypeError:
        raise ConfigError(f"--rollout-sample-filter-path {spec}: returned {type(keep).__name__}; expected a "
                          f"list of {len(samples)} bools (True = train on the sample)") from None
    if len(keep) != len(samples) or not all(isinstance(k, bool) for k in keep):
        raise ConfigError(f"--rollout-sample-filter-path {spec}: returned {len(keep)} values for {len(samples)} "
                          f"samples; expected one bool per sample (True = train on it)")
    removed = 0
    for s, k in zip(samples, keep):
        if not k:
            s.loss_mask = np.zeros(s.response_length, dtype=MASK_DTYPE)
            removed += 1
    return removed


def _as_result(value: Any, fn: GroupFilter) -> FilterResult:
    name = getattr(fn, "__name__", "filter")
    if isinstance(value, FilterResult):
        return FilterResult(value.keep, value.reason or (None if value.keep else name))
    if isinstance(value, bool):
        return FilterResult(value, None if value else name)
    raise ConfigError(f"group filter {name} returned {type(value).__name__}; expected bool or FilterResult")


@dataclass
class Collected:
    """The groups of one rollout, in draw order, with what it took to get them."""

    groups: list[list[Sample]]
    prompts: list[Prompt]
    metrics: dict[str, float]
    exhausted: bool = False  # the source ran out before the batch was full
    # groups the filters dropped (consumed: their prompts are not served again), for
    # logging or slime-style processing of all samples
    dropped_groups: list[list[Sample]] = field(default_factory=list)
    dropped_prompts: list[Prompt] = field(default_factory=list)


@dataclass
class _Flight:
    seq: int
    prompt: Prompt
    task: asyncio.Task = field(repr=False)


class DynamicSamplingStalled(UserError):
    """Dynamic sampling drew its limit of groups without filling the batch."""


class GroupCollector:
    """Draws prompts, runs groups, filters them, until `rollout_batch_size` are kept.

    `run_group(prompt)` generates and scores one prompt's group (the driver's code).
    `abort()` asks the engines to stop in-flight requests, so that their groups return
    quickly with status ABORTED; groups still running `abort_timeout_s` after it are
    cancelled. `max_groups` bounds the draws of one rollout (None: until the data ends).
    """

    def __init__(self, source: DataSource, run_group: GroupRunner, *, rollout_batch_size: int,
                 over_sampling_batch_size: int | None = None, filters: Sequence[GroupFilter] = (),
                 partial_rollout: bool = False, abort: Callable[[], Awaitable[None]] | None = None,
                 abort_timeout_s: float = 60.0, max_groups: int | None = None):
        if rollout_batch_size < 1:
            raise ConfigError(f"--rollout-batch-size must be >= 1, got {rollout_batch_size}")
        over = rollout_batch_size if over_sampling_batch_size is None else over_sampling_batch_size
        if over < 1:
            raise ConfigError(f"--over-sampling-batch-size must be >= 1, got {over}")
        self.source = source
        self.run_group = run_group
        self.rollout_batch_size = rollout_batch_size
        self.over_sampling_batch_size = over
        self.filters = list(filters)
        self.partial_rollout = partial_rollout
        self.abort = abort
        self.abort_timeout_s = abort_timeout_s
        self.max_groups = max_groups

    async def collect(self) -> Collected:
        target = self.rollout_batch_size
        kept: list[tuple[int, Prompt, list[Sample]]] = []
        dropped: list[tuple[int, Prompt, list[Sample]]] = []
        flights: dict[asyncio.Task, _Flight] = {}
        counts: collections.Counter[str] = collections.Counter()
        drops: collections.Counter[str] = collections.Counter()
        seq = 0
        exhausted = False
        try:
            while len(kept) < target:
                # Keep enough groups in flight that, if all pass, the batch fills.
                while not exhausted and len(kept) + len(flights) < target:
                    if self.max_groups is not None and counts["drawn"] >= self.max_groups:
                        break
                    prompts = self.source.take(self.over_sampling_batch_size)
                    if len(prompts) < self.over_sampling_batch_size:
                        exhausted = True
                    for p in prompts:
                        task = asyncio.ensure_future(self.run_group(p))
                        flights[task] = _Flight(seq, p, task)
                        seq += 1
                    counts["drawn"] += len(prompts)
                if not flights:
                    break
                done, _ = await asyncio.wait(flights, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=lambda t: flights[t].seq):
                    flight = flights.pop(task)
                    group = task.result()  # a failed group fails the rollout (the cursor is not saved)
                    if any(s.status == SampleStatus.ABORTED for s in group):
                        # aborted under us (e.g. a weight update): serve again later
                        self._hand_back(flight.prompt, group)
                        counts["returned"] += 1
                        continue
                    if len(kept) >= target:
                        self._hand_back(flight.prompt, group)  # finished but not needed: keep its work
                        counts["returned"] += 1
                        continue
                    verdict = self._judge(group)
                    if verdict.keep:
                        kept.append((flight.seq, flight.prompt, group))
                    else:
                        drops[verdict.reason or "filtered"] += 1
                        dropped.append((flight.seq, flight.prompt, group))
            if len(kept) < target and not exhausted and self.max_groups is not None:
                raise DynamicSamplingStalled(
                    f"dynamic sampling drew {counts['drawn']} groups (the limit for one rollout) and kept only "
                    f"{len(kept)} of {target}; drops: {dict(drops)}. The rewards of most groups do not vary: check "
                    "the reward function, or the task is too easy or too hard for the model"
                )
        except asyncio.CancelledError:
            # A stop mid-rollout (preempt): the kept groups will not be committed, so they go
            # back too - with partial rollout their finished samples are served again as they are.
            for _, prompt, group in sorted(kept, key=lambda k: k[0]):
                self._hand_back(prompt, group)
            counts["returned"] += len(kept)
            kept.clear()
            raise
        finally:
            if flights:
                counts["returned"] += await self._return_in_flight(flights)
        kept.sort(key=lambda k: k[0])
        metrics: dict[str, float] = {
            "rollout/filter/groups_drawn": float(counts["drawn"]),
            "rollout/filter/groups_kept": float(len(kept)),
            "rollout/filter/groups_dropped": float(sum(drops.values())),
            "rollout/filter/groups_returned": float(counts["returned"]),
        }
        judged = len(kept) + sum(drops.values())
        metrics["rollout/filter/keep_rate"] = len(kept) / judged if judged else 0.0
        for reason, n in sorted(drops.items()):
            metrics[f"rollout/filter/drop_{reason}"] = float(n)
        return Collected(groups=[g for _, _, g in kept], prompts=[p for _, p, _ in kept], metrics=metrics,
                         exhausted=exhausted and len(kept) < target,
                         dropped_groups=[g for _, _, g in dropped], dropped_prompts=[p for _, p, _ in dropped])

    def _judge(self, group: list[Sample]) -> FilterResult:
        for f in self.filters:
            verdict = _as_result(f(group), f)
            if not verdict.keep:
                return verdict
        return FilterResult(True)

    def _hand_back(self, prompt: Prompt, group: list[Sample] | None) -> None:
        partial = _partials(group) if (self.partial_rollout and group) else None
        prompt.partial = None
        self.source.push_back(prompt, partial)

    async def _return_in_flight(self, flights: dict[asyncio.Task, _Flight]) -> int:
        """Abort the groups still generating and give their prompts back to the source."""
        if self.abort is not None:
            try:
                await self.abort()
            except Exception as e:  # still hand the prompts back; the caller sees the tasks' fate
                log.warning("abort of in-flight groups failed: %s", e)
        done, still = await asyncio.wait(flights, timeout=self.abort_timeout_s) if flights else (set(), set())
        for task in still:
            task.cancel()
        if still:
            await asyncio.wait(still)
        for task in sorted(flights, key=lambda t: flights[t].seq):
            group = None
            if not task.cancelled() and task.exception() is None:
                group = task.result()
            self._hand_back(flights[task].prompt, group)
        n = len(flights)
        flights.clear()
        return n


def _partials(group: list[Sample]) -> list[PartialSample] | None:
    """A group's tokens so far, or None when they cannot be continued (no logprobs)."""
    out = []
    for s in group:
        if s.rollout_logprobs is None:
            return None
        out.append(PartialSample(
            output_ids=[int(t) for t in s.response_tokens],
            output_logprobs=[float(x) for x in s.rollout_logprobs],
            loss_mask=[int(m) for m in s.effective_loss_mask()],
            weight_version=int(s.weight_version),
            status=s.status.value,
            # one version (nothing recorded): every token is from s.weight_version
            version_runs=s.metadata.get(META_RUNS),
        ))
    return out
