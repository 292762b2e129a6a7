"""--rollout-function-path: a function of one's own generates a whole rollout.

    async def my_rollout(ctx: RolloutContext) -> RolloutOutput

The driver still owns everything around the generation: the weight gate, eval, the commit with
the data cursor, the metrics, the end of the data, and stop/preempt. In place of its own loop
(GroupCollector: over-sampling, dynamic-sampling filters, hand-back of unfinished groups) it awaits
the function once per rollout and commits what it returns, exactly like its own groups:
numbered by `number_samples`, --rollout-sample-filter-path applied, then committed.

What the function gets (`RolloutContext`): the rollout id and the weight version the gate let
through; `source`, the prompt source to `take(n)` prompts from and to `push_back(prompt,
partials)` the ones it does not finish; `engine`, the router's `GenerateContext` (the same one a
generate function gets: `await ctx.engine.generate(input_ids, sampling_params)`); the tokenizer;
the reward function; the rollout's sampling params; the whole typed config (`cfg`, `rollout`);
and the driver's own pieces to build on: `run_group(prompt)` (one prompt's group exactly as the
driver makes it: --custom-generate-function-path, the reward, --rollout-max-context-len),
`score(prompt, generations)` and `abort()` (stop every in-flight engine request).

What it returns (`RolloutOutput`, or the `Collected` of a GroupCollector it ran itself): exactly
--rollout-batch-size groups of --n-samples-per-prompt samples each - the trainer's batch - with the
prompt each group came from. A group is a list of Samples (scored, as `run_group` returns them)
or of Generations (the driver scores them with the reward function, like its own). Anything else
is a one-line error naming the flag and what came back. Fewer groups are accepted only when the
source ran out (a `take` returned fewer prompts than asked): then, as with the driver's own
loop, nothing is committed and the run ends after the rollouts before this one.

Stop/preempt: the driver cancels the function (asyncio.CancelledError inside it), then hands
back every prompt it took and had not pushed back, so the saved cursor serves them again, and
aborts the engines' requests (a cancelled HTTP call does not end its generation). After
a normal return, a prompt it took and neither returned nor pushed back is used up, like a group a
filter drops.

Coming from slime (`generate_rollout(args, rollout_id, data_source, evaluation=False)` returning
RolloutFnTrainOutput(samples=list[list[Sample]], metrics)): the same job and the same shape rule
(rollout_batch_size groups of n_samples_per_prompt), but
* async, one argument: the driver runs one event loop, and a stop must be able to cancel the
  function between two awaits (a blocking function would hold the stop and the heartbeats);
  `ctx.cfg` is the typed RunConfig instead of slime's argparse namespace;
* training rollouts only: eval keeps rlslurm's own (--eval-*), so there is no `evaluation` argument
  and no --eval-function-path;
* groups come back with their prompts (`RolloutOutput.prompts`): rlslurm's Sample does not carry
  its prompt record, and the commit saves which records were used (the data cursor);
* `data_source.get_samples(n)` / `add_samples(groups)` are `ctx.source.take(n)` /
  `ctx.source.push_back(prompt, partials)`;
* --rollout-sample-filter-path is applied by the driver after the function, not by it, and the
  driver (not the function) commits, logs metrics and handles the end of the data.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlslurm.buffer.sample import Sample, SampleStatus
from rlslurm.errors import ConfigError
from rlslurm.plugins import load_callable
from rlslurm.rollout.data import DataSource, PartialSample, Prompt
from rlslurm.rollout.generate_api import GenerateContext, Generation
from rlslurm.rollout.rewards import RewardFn
from rlslurm.settings.config import RolloutSection, RunConfig

log = logging.getLogger(__name__)

FLAG = "--rollout-function-path"


@dataclass
class RolloutOutput:
    """One rollout's groups, each with the prompt it came from; `metrics` are logged with the
    rollout (rollout_metrics.jsonl, TensorBoard, W&B) next to the driver's own."""

    groups: list[list[Sample]] | list[list[Generation]]
    prompts: list[Prompt]
    metrics: dict[str, float] = field(default_factory=dict)


class TrackedSource:
    """The driver's data source as the function sees it: it remembers which prompts were taken and
    not pushed back (handed back when the function is cancelled) and whether a take came back short
    (the data ran out). Everything else is the source's own."""

    def __init__(self, source: DataSource):
        self._source = source
        self.outstanding: dict[int, Prompt] = {}  # id(prompt) -> prompt, in take order
        self.taken = 0
        self.pushed_back = 0
        self.ran_out = False

    def take(self, n: int) -> list[Prompt]:
        got = self._source.take(n)
        if len(got) < n:
            self.ran_out = True
        for p in got:
            self.outstanding[id(p)] = p
        self.taken += len(got)
        return got

    def push_back(self, prompt: Prompt, partial: list[PartialSample] | None = None) -> None:
        self.outstanding.pop(id(prompt), None)
        self.pushed_back += 1
        self._source.push_back(prompt, partial)

    def hand_back_outstanding(self) -> int:
        """Push back every prompt still out (a cancelled function's); returns how many."""
        todo = list(self.outstanding.values())
        for p in todo:
            self.push_back(p, None)
        return len(todo)

    def __getattr__(self, name: str) -> Any:  # state_dict, metrics, num_records, ...
        return getattr(self._source, name)


@dataclass
class RolloutContext:
    """What a --rollout-function-path function gets (module docstring)."""

    rollout_id: int
    weight_version: int             # the oldest engine version the weight gate let through
    source: TrackedSource
    engine: GenerateContext         # the router: `await engine.generate(input_ids, sampling_params)`
    tokenizer: Any
    reward_fn: RewardFn
    sampling_params: dict[str, Any]
    cfg: RunConfig
    run_group: Callable[[Prompt], Awaitable[list[Sample]]]
    score: Callable[[Prompt, Sequence[Generation]], Awaitable[list[Sample]]]
    abort: Callable[[], Awaitable[None]]

    @property
    def rollout(self) -> RolloutSection:
        return self.cfg.rollout


RolloutFn = Callable[[RolloutContext], Awaitable[Any]]


def load_rollout_fn(spec: str) -> RolloutFn:
    """The --rollout-function-path function: async, callable with one argument (the context)."""
    fn = load_callable(spec, what=FLAG, min_args=1)
    if not inspect.iscoroutinefunction(fn) and not inspect.iscoroutinefunction(getattr(fn, "__call__", None)):
        raise ConfigError(f"{FLAG} {spec!r}: must be an async function (async def f(ctx)): it runs on the "
                          "rollout driver's event loop, where a stop cancels it")
    return fn


# the driver's own collector knobs: the function replaces that loop, so they would do nothing
REPLACED_BY_ROLLOUT_FN = {
    "partial_rollout": "the function decides what to hand back: ctx.source.push_back(prompt, partials)",
    "over_sampling_batch_size": "the function draws its own prompts (ctx.source.take(n))",
    "dynamic_sampling_filter_path": "the function filters its own groups (e.g. GroupCollector(ctx.source, "
                                    "ctx.run_group, filters=[...]))",
}


def refuse_combinations(r: RolloutSection) -> None:
    """The flags that configure the driver's own loop, which --rollout-function-path replaces."""
    if not r.rollout_function_path:
        return
    for name, why in REPLACED_BY_ROLLOUT_FN.items():
        if getattr(r, name):
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} does nothing with {FLAG} (it replaces the driver's group loop): {why}; "
                              f"drop {flag}")


@dataclass
class Returned:
    """A validated function result: Sample or Generation groups with their prompts."""

    groups: list[list[Sample] | list[Generation]]
    prompts: list[Prompt]
    metrics: dict[str, float]
    exhausted: bool  # fewer groups than --rollout-batch-size because the source ran out


def check_output(out: Any, *, spec: str, rollout_id: int, rollout_batch_size: int, n_samples_per_prompt: int,
                 ran_out: bool) -> Returned:
    """The function's result, or a one-line error naming the flag and what came back."""
    head = f"{FLAG} {spec} (rollout {rollout_id})"
    groups, prompts = getattr(out, "groups", None), getattr(out, "prompts", None)
    if not isinstance(groups, list) or not isinstance(prompts, list):
        raise ConfigError(f"{head} returned {type(out).__name__}; expected RolloutOutput(groups, prompts) "
                          "(rlslurm.rollout.rollout_fn) with one prompt per group")
    metrics = getattr(out, "metrics", None) or {}
    if not isinstance(metrics, Mapping) or not all(isinstance(v, (int, float)) for v in metrics.values()):
        raise ConfigError(f"{head} returned metrics that are not a dict of numbers")
    if len(groups) != len(prompts):
        raise ConfigError(f"{head} returned {len(groups)} groups but {len(prompts)} prompts; one prompt per group")
    ran_out = bool(getattr(out, "exhausted", False)) or ran_out
    if len(groups) != rollout_batch_size and not (ran_out and len(groups) < rollout_batch_size):
        raise ConfigError(f"{head} returned {len(groups)} groups; --rollout-batch-size is {rollout_batch_size} "
                          f"(groups of --n-samples-per-prompt {n_samples_per_prompt} samples each)")
    for i, (group, prompt) in enumerate(zip(groups, prompts)):
        if not isinstance(prompt, Prompt):
            raise ConfigError(f"{head}: prompts[{i}] is a {type(prompt).__name__}, not a Prompt from ctx.source")
        kinds = {type(x) for x in group} if isinstance(group, list) else set()
        if not isinstance(group, list) or kinds - {Sample, Generation} or len(kinds) > 1:
            got = type(group).__name__ if not isinstance(group, list) else \
                f"a list of {', '.join(sorted(k.__name__ for k in kinds))}"
            raise ConfigError(f"{head}: group {i} is {got}; expected a list of Samples or of Generations")
        if len(group) != n_samples_per_prompt:
            raise ConfigError(f"{head}: group {i} ({prompt.where or f'prompt {prompt.index}'}) has {len(group)} "
                              f"samples; --n-samples-per-prompt is {n_samples_per_prompt}")
        for k, x in enumerate(group):
            if SampleStatus(x.status) == SampleStatus.ABORTED:
                raise ConfigError(f"{head}: group {i} sample {k} is aborted; hand its prompt back "
                                  "(ctx.source.push_back) instead of returning it")
    return Returned(groups=list(groups), prompts=list(prompts), metrics=dict(metrics),
                    exhausted=len(groups) < rollout_batch_size)


ABORT_TIMEOUT_S = 60.0


async def call_rollout_fn(fn: RolloutFn, ctx: RolloutContext) -> Any:
    """Await the function; when it is cancelled (a stop), hand back the prompts it still holds and
    stop the engine requests it left running (a cancelled HTTP call does not end its generation)."""
    try:
        return await fn(ctx)
    except asyncio.CancelledError:
        ctx.source.hand_back_outstanding()
        try:
            await asyncio.wait_for(ctx.abort(), ABORT_TIMEOUT_S)
        except Exception as e:  # the prompts are back; the stop goes on
            log.warning("abort after the stopped %s function failed: %s", FLAG, e)
        raise
