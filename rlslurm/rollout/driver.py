"""The rollout driver: prompts -> groups through the router -> rewards -> filters -> buffer.

One rollout at a time, in id order:

1. **Weight gate.** Rollout N may be generated only when the engines serve weight version
   >= N - async_buffer_size (version N = weights after training rollouts 0..N-1, version
   0 = the HF checkpoint; async_buffer_size 0 is synchronous RL). The engines' *own*
   `/model_info` weight_version is what counts, not Control's record: engines of a new
   attempt start at 0 whatever the record from the previous attempt says. In disk mode
   the driver moves the engines itself: when Control's version is ahead of an engine, it
   loads RUN/weights/v<N> there (all lagging engines concurrently).
2. **Eval** every `eval_interval` rollouts, against the weights that passed the gate (rollout 0's
   not with --skip-eval-before-train).
3. **Generate** `rollout_batch_size` groups of `n_samples_per_prompt` (GroupCollector:
   over-sampling, dynamic-sampling filters, aborted groups handed back), or whatever the
   --rollout-function-path function does instead (rollout/rollout_fn.py), checked to that shape.
4. **Commit** with the data cursor after it, then append a metrics line to
   RUN/rollout_metrics.jsonl (RUN/metrics.jsonl is the trainer's: one writer per file) and, with
   --use-wandb, to the rollout's W&B run (rlslurm/metrics_sink.py).

--debug-train-only (no engines, no router; rollout/main.py `serve_without_engines`): the same loop with
the --rollout-function-path function building every rollout (default SFT, rollout/sft.py; its
`ctx.engine` is None), and a gate that keeps the driver at most --async-buffer-size + 1 rollouts
ahead of the version the trainer recorded (`_wait_for_trainer`); no eval.

Between rollouts (and while waiting at the weight gate) the driver regenerates rollouts the
trainer quarantined as corrupt: in sync mode the trainer waits for exactly that rollout,
so waiting for the next weight version instead would deadlock.

Restart safety: a rollout exists only once committed, and the cursor saved with it is the
source's position after it, so a driver killed anywhere resumes from the last commit
without skipping or repeating a prompt (`RolloutWriter.resume_point`). A driver *stopped*
mid-rollout (preempt, stop request) aborts its requests and saves the cursor with every
drawn-but-uncommitted group handed back (`RolloutWriter.save_handback`); with
--partial-rollout those groups keep their tokens so far, so the next attempt continues
them instead of generating them again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlslurm.buffer.attempts import AttemptSuperseded, superseded
from rlslurm.buffer.control import Control
from rlslurm.buffer.rundir import RunDir
from rlslurm.buffer.sample import RolloutMeta, Sample, SampleStatus
from rlslurm.buffer.sweep import sweep
from rlslurm.buffer.writer import RolloutWriter
from rlslurm.engines.sglang_client import SGLangClient, SGLangError
from rlslurm.errors import ConfigError, DataError
from rlslurm.job.env import job_env
from rlslurm.metrics_sink import JsonlSink, MetricSinks, open_sinks
from rlslurm.rollout.data import DataSource, Prompt, PromptSource, load_custom_source
from rlslurm.rollout.filters import (
    Collected,
    GroupCollector,
    GroupFilter,
    apply_sample_filter,
    load_filter,
    load_sample_filter,
)
from rlslurm.rollout.generate_api import (
    META_CARRIED,
    META_MASKED,
    GenerateFn,
    Generation,
    calls_per_group,
    fan_out_of,
    generate_group,
    load_generate_fn,
    score_generations,
)
from rlslurm.rollout.rewards import RewardFn, build_reward_fn
from rlslurm.rollout.rollout_fn import (
    RolloutContext,
    RolloutFn,
    TrackedSource,
    call_rollout_fn,
    check_output,
    load_rollout_fn,
    refuse_combinations,
)
from rlslurm.rollout.router_context import RetryPolicy, RouterContext, parse_weight_version
from rlslurm.rollout.sft import SFT_ROLLOUT_FN
from rlslurm.settings.config import RunConfig
from rlslurm.settings.eval_config import EvalDataset, eval_datasets
from rlslurm.settings.weight_plan import weight_sync_plan

log = logging.getLogger(__name__)

METRICS_FILE = "rollout_metrics.jsonl"
POLL_S = 0.5
EVAL_ABORT_RETRIES = 5

ShouldStop = Callable[[], bool]
EngineUrls = Callable[[], Sequence[str]]


def required_version(rollout_id: int, *, async_buffer_size: int, update_weights_interval: int = 1) -> int:
    """The oldest weight version rollout `rollout_id` may be generated with. The trainer
    publishes only every `update_weights_interval` versions, so the newest one it can
    have published at or below `rollout_id - async_buffer_size` is the bar."""
    floor = max(0, rollout_id - async_buffer_size)
    return floor - floor % update_weights_interval


def gate_open(versions: dict[str, int], need: int, published: int | None) -> bool:
    """May a rollout needing version `need` start with engines at `versions`?

    Every engine must serve >= need, except one that is behind the version the trainer
    last published (`published`): it missed an update (restarted since, so back at 0) and
    would block the gate until the trainer's next update, which waits for this rollout.
    Its supervisor keeps it out of the router until it has the published weights, so it
    serves nothing meanwhile. At least one engine must be current (a new attempt's engines
    all start behind)."""
    if not versions or max(versions.values()) < need:
        return False
    return all(v >= need or (published is not None and v < published) for v in versions.values())


def sampling_params(cfg: RunConfig, *, eval: bool = False) -> dict[str, Any]:
    """SGLang sampling params from the rollout flags. Empty stop lists are left out (the
    router drops nulls but forwards empties, and SGLang treats [] and None alike)."""
    r = cfg.rollout
    sp: dict[str, Any] = {
        "temperature": r.eval_temperature if eval and r.eval_temperature is not None else r.rollout_temperature,
        "top_p": r.eval_top_p if eval and r.eval_top_p is not None else r.rollout_top_p,
        "top_k": r.eval_top_k if eval and r.eval_top_k is not None else r.rollout_top_k,
        "max_new_tokens": (r.eval_max_response_len or r.rollout_max_response_len) if eval
        else r.rollout_max_response_len,
        # the trained response is the engine's tokens: never trim a matched stop from them
        "no_stop_trim": True,
        "skip_special_tokens": False,
    }
    if r.rollout_stop:
        sp["stop"] = list(r.rollout_stop)
    if r.rollout_stop_token_ids:
        sp["stop_token_ids"] = list(r.rollout_stop_token_ids)
    return sp


def max_prompt_len(cfg: RunConfig) -> int | None:
    """--max-prompt-len; with --rollout-max-context-len alone, that - 1 (slime's default: a prompt
    must leave room for one generated token)."""
    ctx = cfg.rollout.rollout_max_context_len
    return cfg.data.max_prompt_len if cfg.data.max_prompt_len is not None or ctx is None else ctx - 1


def build_source(cfg: RunConfig, tokenizer: Any) -> DataSource:
    d = cfg.data
    if d.data_source_path:
        return load_custom_source(d.data_source_path, cfg=cfg, tokenizer=tokenizer)
    if d.prompt_data is None:
        raise ConfigError("--prompt-data is required (or --data-source-path)")
    # SFT conversations are templated whole by rollout/sft.py (not as a prompt with a generation prompt)
    # and carry no label
    sft = cfg.rollout.rollout_function_path == SFT_ROLLOUT_FN
    return PromptSource(d.prompt_data, input_key=d.input_key, label_key=None if sft else d.label_key,
                        metadata_key=d.metadata_key, tool_key=d.tool_key, tokenizer=tokenizer,
                        apply_chat_template=d.apply_chat_template and not sft,
                        chat_template_kwargs=d.apply_chat_template_kwargs,
                        max_prompt_len=None if sft else max_prompt_len(cfg),
                        shuffle=d.rollout_shuffle, seed=d.rollout_seed, num_epochs=d.num_epoch,
                        strict=d.data_strict, buffer_filter=cfg.rollout.buffer_filter_path)


def eval_due(rollout_id: int, cfg: RunConfig) -> bool:
    """Eval before rollouts divisible by --eval-interval; rollout 0's (the untrained weights, slime's
    "eval before train") not with --skip-eval-before-train."""
    r = cfg.rollout
    if not r.eval_interval or rollout_id % r.eval_interval:
        return False
    return not (rollout_id == 0 and r.skip_eval_before_train)


def eval_sampling_params(cfg: RunConfig, ds: EvalDataset) -> dict[str, Any]:
    """One eval dataset's SGLang params: the run's eval params with the dataset's settings."""
    sp = sampling_params(cfg, eval=True)
    sp.update(temperature=ds.temperature, top_p=ds.top_p, top_k=ds.top_k, max_new_tokens=ds.max_response_len)
    for key, value in (("stop", ds.stop), ("stop_token_ids", ds.stop_token_ids)):
        if value:
            sp[key] = list(value)
        else:
            sp.pop(key, None)
    return sp


@dataclass
class DriverResult:
    reason: str                 # "done" | "stopped" | "exhausted"
    next_rollout_id: int
    committed: list[int] = field(default_factory=list)
    evaluated: list[int] = field(default_factory=list)
    regenerated: list[int] = field(default_factory=list)  # quarantined ids committed again
    handback: Path | None = None  # where a stop saved the cursor of the unfinished rollout


class _RegenerateFirst(Exception):
    """A quarantined rollout older than the one waiting at the weight gate must come first."""


class RolloutDriver:
    """Generates and commits rollouts until `num_rollout`, a stop, or the end of the data.

    `engine_urls()` lists every engine (all rollout nodes) for weight versions, disk
    loads and abort; requests go through `router_url`. `engine_restarts()` reports the
    supervisor's count for the metrics.
    """

    def __init__(self, cfg: RunConfig, run: RunDir | str | Path, *, router_url: str | None, engine_urls: EngineUrls,
                 api_key: str | None, tokenizer: Any, source: DataSource | None = None,
                 reward_fn: RewardFn | None = None, generate_fn: GenerateFn | None = None,
                 filters: Sequence[GroupFilter] | None = None, engine_restarts: Callable[[], int] | None = None,
                 reward_executor: Any = None, retry: RetryPolicy | None = None, poll_s: float = POLL_S,
                 recovering: Callable[[], bool] | None = None):
        self.cfg = cfg
        self.plan = weight_sync_plan(cfg)  # the weight-sync settings (rlslurm/settings/weight_plan.py): disk loads
        # what it does now, for the node's heartbeat (`rlslurm status`: why no rollout comes)
        self.phase = "starting the driver"
        self.rd = run if isinstance(run, RunDir) else RunDir(run)
        self.router_url = router_url
        self.engine_urls = engine_urls
        self.api_key = api_key
        self.tokenizer = tokenizer
        self.source = source if source is not None else build_source(cfg, tokenizer)
        r = cfg.rollout
        self.reward_fn = reward_fn or build_reward_fn(r.rm_type, custom_rm_path=r.custom_rm_path, rm_url=r.rm_url,
                                                      rm_api_key=None)
        self.generate_fn = generate_fn or load_generate_fn(r.custom_generate_function_path)
        check_fan_out(self.generate_fn, cfg)
        refuse_combinations(r)
        self.rollout_fn: RolloutFn | None = load_rollout_fn(r.rollout_function_path) if r.rollout_function_path \
            else None
        if filters is None:
            filters = [load_filter(r.dynamic_sampling_filter_path)] if r.dynamic_sampling_filter_path else []
        self.filters = list(filters)
        self.sample_filter = load_sample_filter(r.rollout_sample_filter_path) if r.rollout_sample_filter_path else None
        self.engine_restarts = engine_restarts or (lambda: 0)
        self.reward_executor = reward_executor
        self.retry = retry
        self.recovering = recovering  # node 0's supervisor restarts the router or an engine (router_context.py)
        self.poll_s = poll_s
        self.control = Control(self.rd)
        self.writer = RolloutWriter(self.rd, kind="train")
        self._eval = eval_datasets(cfg)
        self.metrics_path = self.rd.path / METRICS_FILE
        self._sinks: MetricSinks | None = None  # opened at the first record (W&B starts a process)
        self.ctx: RouterContext | None = None
        # --debug-train-only: no router, no engines; the rollout function builds the rollouts (SFT)
        self.engine_free = cfg.builds_without_engines

    # ------------------------------------------------------------------ main loop

    async def run(self, should_stop: ShouldStop = lambda: False) -> DriverResult:
        try:
            return await self._run(should_stop)
        finally:
            self.close_metrics()

    async def _run(self, should_stop: ShouldStop) -> DriverResult:
        sweep(self.rd)  # what killed writers of earlier attempts left (buffer/sweep.py)
        resume = self.writer.resume_point()
        if resume.data_cursor:
            self.source.load_state_dict(resume.data_cursor)
        log.info("rollout driver: next rollout %d, regenerate %s%s", resume.next_rollout_id, resume.to_regenerate,
                 " (continuing the groups a stopped driver handed back)" if resume.from_handback else "")
        result = DriverResult("done", resume.next_rollout_id)
        next_id = resume.next_rollout_id
        async with _router_client(None if self.engine_free else self.router_url, self.api_key) as client:
            self.ctx = None if client is None else RouterContext(
                client, self.tokenizer, max_concurrency=self.cfg.rollout.rollout_max_concurrency, retry=self.retry,
                recovering=self.recovering)
            while (rollout_id := self._next_rollout(next_id)) is not None:
                if should_stop():  # also between rollouts: one shorter than poll_s never reaches the check inside
                    return self._hand_back(result, f"stopped before rollout {rollout_id}: cursor")
                regenerate = rollout_id < next_id
                if regenerate:
                    log.warning("regenerating rollout %d (the trainer quarantined it as corrupt)", rollout_id)
                stopped, outcome = await self._until_stop(self._one(rollout_id, result), should_stop)
                if stopped:
                    return self._hand_back(result,
                                           f"stopped in rollout {rollout_id}: cursor with its unfinished groups")
                if outcome == "exhausted":
                    result.reason = "exhausted"
                    return result
                if outcome == "ok":
                    if regenerate:
                        result.regenerated.append(rollout_id)
                    else:
                        next_id = rollout_id + 1
                result.next_rollout_id = max(result.next_rollout_id, next_id)
        return result

    def _hand_back(self, result: DriverResult, what: str) -> DriverResult:
        """A stop: the source's cursor (and any groups a cancelled rollout handed back) saved for the next
        attempt (buffer `save_handback`)."""
        result.handback = self.writer.save_handback(self.source.state_dict())
        log.info("%s saved to %s", what, result.handback)
        result.reason = "stopped"
        return result

    def _next_rollout(self, next_id: int) -> int | None:
        """A quarantined rollout first (oldest first), else the next new one."""
        regen = self.writer.to_regenerate()
        if regen:
            return regen[0]
        return next_id if next_id < self.cfg.rollout.num_rollout else None

    async def _until_stop(self, coro: Any, should_stop: ShouldStop) -> tuple[bool, Any]:
        """Run `coro`; when `should_stop()` turns true cancel it and return (True, None).
        Nothing of a cancelled rollout is committed: its groups are aborted and handed
        back to the source (GroupCollector), whose state the caller then saves."""
        task = asyncio.ensure_future(coro)
        while True:
            done, _ = await asyncio.wait({task}, timeout=self.poll_s)
            if done:
                return False, task.result()
            if should_stop():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                if not task.cancelled():  # it ended on its own meanwhile
                    return False, task.result()
                return True, None

    async def _one(self, rollout_id: int, result: DriverResult) -> str:
        self.phase = f"rollout {rollout_id}: waiting for its weights"
        try:
            version = await self.wait_for_weights(rollout_id)
        except _RegenerateFirst:
            return "deferred"
        if self._eval and eval_due(rollout_id, self.cfg):
            self.phase = f"evaluating before rollout {rollout_id}"
            if await self.evaluate(rollout_id, version):
                result.evaluated.append(rollout_id)
        self.phase = f"generating rollout {rollout_id}"
        committed = await self.generate_rollout(rollout_id, version)
        if not committed:
            return "exhausted"
        result.committed.append(rollout_id)
        return "ok"

    # ------------------------------------------------------------------ weights

    async def engine_versions(self) -> dict[str, int]:
        """Each reachable engine's weight version (an engine being restarted is left out)."""
        urls = list(self.engine_urls())

        async def one(url: str) -> int | None:
            async with SGLangClient(url, self.api_key) as c:
                try:
                    raw = await c.get_weight_version(timeout=10.0)
                except SGLangError:
                    return None
            return parse_weight_version(raw, where=f"{url}/model_info")

        got = await asyncio.gather(*(one(u) for u in urls))
        return {u: v for u, v in zip(urls, got) if v is not None}

    async def wait_for_weights(self, rollout_id: int) -> int:
        """Block until every reachable engine serves a version allowed for `rollout_id`
        (disk mode: load newer published weights first). Returns the oldest engine version."""
        r = self.cfg.rollout
        if self.engine_free:
            return await self._wait_for_trainer(rollout_id)
        need = 0 if self.cfg.train.debug_rollout_only else required_version(  # no trainer publishes
            rollout_id, async_buffer_size=r.async_buffer_size, update_weights_interval=r.update_weights_interval)
        logged = False
        while True:
            versions = await self.engine_versions()
            if versions and self.plan.by_disk:
                versions = await self.sync_from_disk(versions)
            # the published version matters only while some engines have `need` and others do not: read
            # then, not every poll (4 metadata operations on the shared run dir; docs/shared-fs-load.md)
            mixed = bool(versions) and min(versions.values()) < need <= max(versions.values())
            rec = self.control.weight_version() if mixed else None
            if gate_open(versions, need, None if rec is None else rec.version):
                behind = {u: v for u, v in versions.items() if v < need}
                if behind:
                    log.warning("rollout %d starts without engines %s: they missed a weight update (need %d) "
                                "and are not routed until they have it", rollout_id, behind, need)
                return min(versions.values())
            if any(q < rollout_id for q in self.writer.to_regenerate()):
                raise _RegenerateFirst()
            if not logged:
                log.info("rollout %d waits for weight version %d (engines: %s)", rollout_id, need, versions)
                self.phase = f"rollout {rollout_id}: waiting for weight version {need} (engines have {versions})"
                logged = True
            await asyncio.sleep(self.poll_s)

    async def _wait_for_trainer(self, rollout_id: int) -> int:
        """Without engines no weights enter a rollout, so none is stale: the gate only keeps the buffer
        from running far ahead of the trainer. Rollout N waits until the trainer has recorded the
        version that would let rollout N - 1 be generated (control/weight_version.json; the trainer
        records it also when it publishes nowhere): at most --async-buffer-size + 1 rollouts ahead."""
        r = self.cfg.rollout
        need = required_version(max(0, rollout_id - 1), async_buffer_size=r.async_buffer_size,
                                update_weights_interval=r.update_weights_interval)
        logged = False
        while True:
            rec = self.control.weight_version()
            have = 0 if rec is None else rec.version
            if have >= need:
                return have
            if any(q < rollout_id for q in self.writer.to_regenerate()):
                raise _RegenerateFirst()
            if not logged:
                log.info("rollout %d waits for the trainer (version %d, it has recorded %d)", rollout_id, need, have)
                logged = True
            await asyncio.sleep(self.poll_s)

    async def sync_from_disk(self, versions: dict[str, int]) -> dict[str, int]:
        """Load Control's published version into every engine that is behind it."""
        rec = self.control.weight_version()
        if rec is None:
            return versions
        lagging = [u for u, v in versions.items() if v < rec.version]
        if not lagging:
            return versions
        path = self.rd.weights_dir / f"v{rec.version}"
        if not path.is_dir():
            raise DataError(str(path), f"{self.control.dir}/weight_version.json says version {rec.version} but its "
                                       "weights directory is missing")
        t0 = time.perf_counter()

        async def load(url: str) -> None:
            async with SGLangClient(url, self.api_key) as c:
                await c.update_weights_from_disk(str(path), weight_version=str(rec.version))

        # concurrently: on a real cluster each load reads GBs, and they do not depend on each other
        await asyncio.gather(*(load(u) for u in lagging))
        log.info("loaded weights v%d on %d engine(s) in %.1f s", rec.version, len(lagging), time.perf_counter() - t0)
        return {**versions, **{u: rec.version for u in lagging}}

    async def abort_engines(self) -> None:
        """Stop every in-flight request (the router has no abort): their groups come back
        ABORTED and the collector hands the prompts back."""
        async def one(url: str) -> None:
            async with SGLangClient(url, self.api_key) as c:
                try:
                    await c.abort_all(timeout=10.0)
                except SGLangError as e:
                    log.warning("abort on %s failed: %s", url, e)

        await asyncio.gather(*(one(u) for u in self.engine_urls()))

    # ------------------------------------------------------------------ train rollouts

    def _draw_limit(self) -> int | None:
        """Without --num-epoch the prompts never run out, so filters that drop every group would draw
        forever: one rollout may draw one epoch's prompts (at least two over-sampling batches), then
        stops with DynamicSamplingStalled's message. With --num-epoch the data's end bounds it."""
        n = getattr(self.source, "num_records", None)
        if self.cfg.data.num_epoch is not None or not self.filters or n is None:
            return None
        r = self.cfg.rollout
        return max(int(n), 2 * (r.over_sampling_batch_size or r.rollout_batch_size))

    async def generate_rollout(self, rollout_id: int, engine_version: int) -> bool:
        """Generate, filter and commit rollout `rollout_id`. False when the data ran out first
        (nothing is committed, the cursor is not advanced)."""
        assert self.ctx is not None or self.engine_free
        r = self.cfg.rollout
        sp = sampling_params(self.cfg)
        before = self.ctx.stats.snapshot() if self.ctx is not None else {}
        restarts0 = self.engine_restarts()

        async def run_group(prompt: Prompt) -> list[Sample]:
            return await generate_group(self.ctx, prompt, n=r.n_samples_per_prompt, sampling_params=sp,
                                        reward_fn=self.reward_fn, generate_fn=self.generate_fn,
                                        reward_key=r.reward_key, reward_executor=self.reward_executor,
                                        mask_offpolicy=r.mask_offpolicy_in_partial_rollout,
                                        max_context_len=r.rollout_max_context_len,
                                        skip_special_tokens=r.rollout_skip_special_tokens)

        t0 = time.perf_counter()
        if self.rollout_fn is not None:
            collected = await self._collect_with_rollout_fn(rollout_id, engine_version, sp, run_group)
        else:
            collector = GroupCollector(self.source, run_group, rollout_batch_size=r.rollout_batch_size,
                                       over_sampling_batch_size=r.over_sampling_batch_size, filters=self.filters,
                                       partial_rollout=r.partial_rollout, abort=self.abort_engines,
                                       max_groups=self._draw_limit())
            collected = await collector.collect()
        gen_s = time.perf_counter() - t0
        if collected.exhausted or len(collected.groups) < r.rollout_batch_size:
            why = (f"the prompt data ran out in rollout {rollout_id} of --num-rollout {r.num_rollout} "
                   f"({len(collected.groups)} of --rollout-batch-size {r.rollout_batch_size} groups; "
                   + (f"--num-epoch {self.cfg.data.num_epoch})" if self.cfg.data.num_epoch is not None else
                      "no --num-epoch: an epoch served no prompt at all)"))
            log.warning("%s: no further rollout", why)
            # the trainer ends the run after the rollouts before this one (trainer/main.py)
            self.control.mark_data_exhausted(rollout_id, job_env().attempt, why)
            return False
        samples = number_samples(collected.groups, collected.prompts)
        if r.rollout_sample_filter_path:
            collected.metrics["rollout/sample_filter/removed"] = float(apply_sample_filter(
                self.sample_filter, r.rollout_sample_filter_path, samples))
        metrics = {**collected.metrics, **generation_metrics(samples, gen_s),
                   **(_delta(self.ctx.stats.snapshot(), before) if self.ctx is not None else {}),
                   "rollout/engine_version": float(engine_version),
                   "rollout/engine/restarts_total": float(self.engine_restarts()),
                   "rollout/engine/restarts": float(self.engine_restarts() - restarts0)}
        metrics.update(getattr(self.source, "metrics", lambda: {})())
        t1 = time.perf_counter()
        if superseded(self.rd, job_env().attempt):  # an orphan of a lost attempt: the new one commits this id
            raise AttemptSuperseded(f"attempt {job_env().attempt}: a later attempt of the run started; rollout "
                                    f"{rollout_id} is not committed by this one")
        self.writer.commit(rollout_id, samples, RolloutMeta(kind="train", data_cursor=self.source.state_dict(),
                                                            metrics=metrics))
        self.writer.clear_handback()
        metrics["rollout/time/commit_s"] = time.perf_counter() - t1
        self.log_metrics(rollout_id, "train", metrics)
        log.info("committed rollout %d: %d samples, reward %.3f, %.1f s", rollout_id, len(samples),
                 metrics["rollout/reward_mean"], gen_s)
        return True

    async def _collect_with_rollout_fn(self, rollout_id: int, engine_version: int, sp: dict[str, Any],
                                       run_group: Callable[[Prompt], Any]) -> Collected:
        """One rollout's groups from the --rollout-function-path function, checked and scored
        (Generation groups), in the shape GroupCollector returns."""
        assert (self.ctx is not None or self.engine_free) and self.rollout_fn is not None
        r = self.cfg.rollout
        source = TrackedSource(self.source)

        async def score(prompt: Prompt, gens: Sequence[Generation]) -> list[Sample]:
            return await score_generations(self.ctx, prompt, list(gens), reward_fn=self.reward_fn,
                                           reward_key=r.reward_key, reward_executor=self.reward_executor,
                                           skip_special_tokens=r.rollout_skip_special_tokens)

        ctx = RolloutContext(rollout_id=rollout_id, weight_version=engine_version, source=source, engine=self.ctx,
                             tokenizer=self.tokenizer, reward_fn=self.reward_fn, sampling_params=dict(sp),
                             cfg=self.cfg, run_group=run_group, score=score, abort=self.abort_engines)
        out = await call_rollout_fn(self.rollout_fn, ctx)
        got = check_output(out, spec=str(r.rollout_function_path), rollout_id=rollout_id,
                           rollout_batch_size=r.rollout_batch_size, n_samples_per_prompt=r.n_samples_per_prompt,
                           ran_out=source.ran_out)
        groups = [g if not g or isinstance(g[0], Sample) else await score(p, g)  # type: ignore[arg-type]
                  for g, p in zip(got.groups, got.prompts)]
        metrics = {**{k: float(v) for k, v in got.metrics.items()},
                   "rollout/function/prompts_taken": float(source.taken),
                   "rollout/function/prompts_pushed_back": float(source.pushed_back)}
        return Collected(groups=groups, prompts=got.prompts, metrics=metrics, exhausted=got.exhausted)

    # ------------------------------------------------------------------ eval

    async def evaluate(self, rollout_id: int, engine_version: int) -> bool:
        """Eval rollout `rollout_id` (the weights rollout `rollout_id` is generated with),
        every dataset in one eval rollout; False if it was committed before a restart."""
        assert self.ctx is not None
        writer = RolloutWriter(self.rd, kind="eval")
        if writer.is_committed(rollout_id):
            return False
        samples: list[Sample] = []
        metrics: dict[str, float] = {"eval/engine_version": float(engine_version)}
        t0 = time.perf_counter()
        for ds in self._eval:
            d, name, path, k = self.cfg.data, ds.name, ds.path, ds.n_samples_per_eval_prompt
            sp = eval_sampling_params(self.cfg, ds)
            src = PromptSource(path, input_key=ds.input_key, label_key=ds.label_key, metadata_key=ds.metadata_key,
                               tool_key=ds.tool_key, tokenizer=self.tokenizer,
                               apply_chat_template=ds.apply_chat_template,
                               chat_template_kwargs=d.apply_chat_template_kwargs, shuffle=False, num_epochs=1,
                               strict=d.data_strict, flag="--eval-config" if d.eval_config else "--eval-prompt-data")
            prompts = src.take(src.num_records)
            src.close()
            if ds.rm_type is not None:  # slime's per-dataset rm_type: the record's rule (rollout/rewards.py)
                for p in prompts:
                    p.metadata = {**p.metadata, "rm_type": ds.rm_type}
            groups = await asyncio.gather(*(self._eval_group(p, k, sp, f"eval dataset {name} ({path})")
                                            for p in prompts))
            for g in groups:
                for s in g:
                    s.metadata["eval_dataset"] = name
            metrics.update(eval_metrics(name, groups, k))
            base = len(samples)
            samples += number_samples(groups, prompts, first_group=len({s.group_index for s in samples}))
            assert len(samples) == base + len(prompts) * k
        metrics["eval/time_s"] = time.perf_counter() - t0
        writer.commit(rollout_id, samples, RolloutMeta(kind="eval", metrics=metrics))
        self.log_metrics(rollout_id, "eval", metrics)
        log.info("eval at rollout %d: %s", rollout_id,
                 {k_: round(v, 4) for k_, v in metrics.items() if k_.endswith("reward_mean")})
        return True

    async def _eval_group(self, prompt: Prompt, k: int, sp: dict[str, Any], where: str) -> list[Sample]:
        """One eval group; generated again when a weight update aborted it (an aborted
        sample has no reward, and a score from the remaining ones would be biased)."""
        assert self.ctx is not None
        r = self.cfg.rollout
        for _ in range(EVAL_ABORT_RETRIES):
            group = await generate_group(self.ctx, prompt, n=k, sampling_params=sp, reward_fn=self.reward_fn,
                                         generate_fn=self.generate_fn, n_flag="--n-samples-per-eval-prompt",
                                         reward_key=r.reward_key,
                                         reward_executor=self.reward_executor,
                                         max_context_len=r.rollout_max_context_len,
                                         skip_special_tokens=r.rollout_skip_special_tokens)
            if not any(s.status == SampleStatus.ABORTED for s in group):
                return group
        raise DataError(where, f"prompt {prompt.where or prompt.index} aborted {EVAL_ABORT_RETRIES} times in a row")

    # ------------------------------------------------------------------ metrics

    def log_metrics(self, rollout_id: int, kind: str, metrics: dict[str, float]) -> None:
        """One JSON line per rollout, appended and fsynced (a requeue may follow at any time), and
        the same record to TensorBoard (RUN/tb/rollout, step = rollout id; the trainer's scalars are
        in RUN/tb at its optimizer step) and to the rollout's W&B run with --use-wandb
        (rlslurm/metrics_sink.py)."""
        if self._sinks is None:
            jsonl = JsonlSink(self.metrics_path,
                              lambda rec: f"the metrics of {rec['kind']} rollout {rec['rollout_id']}",
                              sort_keys=True)
            self._sinks = open_sinks("rollout", jsonl, tb_dir=self.rd.tb_dir / "rollout", cfg=self.cfg,
                                     attempt=job_env().attempt)
        self._sinks.log({"rollout_id": rollout_id, "kind": kind, "time": time.time(), **metrics},
                        step=rollout_id, rollout_id=rollout_id)

    def close_metrics(self) -> None:
        if self._sinks is not None:
            self._sinks.close()
            self._sinks = None


@contextlib.asynccontextmanager
async def _router_client(url: str | None, api_key: str | None):
    """The router's client, or None without engines (--debug-train-only)."""
    if url is None:
        yield None
        return
    async with SGLangClient(url, api_key) as client:
        yield client


def check_fan_out(generate_fn: GenerateFn, cfg: RunConfig) -> None:
    """A @fan_out(k) generate function: k divides every group size it makes, and no partial
    rollout (generate_api's module docstring says why). Submit runs the same check."""
    if fan_out_of(generate_fn) == 1:
        return
    r = cfg.rollout
    if r.partial_rollout:
        raise ConfigError(f"--partial-rollout: --custom-generate-function-path {r.custom_generate_function_path} "
                          f"fans out (@fan_out({fan_out_of(generate_fn)})), and a call producing several samples "
                          "cannot continue a handed-back group's partial samples")
    calls_per_group(generate_fn, r.n_samples_per_prompt, "--n-samples-per-prompt")
    for ds in eval_datasets(cfg):
        calls_per_group(generate_fn, ds.n_samples_per_eval_prompt,
                        f"--n-samples-per-eval-prompt (eval dataset {ds.name})")


def number_samples(groups: Sequence[list[Sample]], prompts: Sequence[Prompt], *, first_group: int = 0) -> list[Sample]:
    """Flatten groups in order: group_index = the group's place in the rollout (GRPO's
    normaliser), index = the sample's; the prompt's identity stays in the metadata."""
    out: list[Sample] = []
    for gi, (group, prompt) in enumerate(zip(groups, prompts)):
        for s in group:
            s.group_index = first_group + gi
            s.index = len(out)
            s.metadata = {**s.metadata, "prompt_index": prompt.index, "prompt_epoch": prompt.epoch}
            out.append(s)
    return out


def generation_metrics(samples: Sequence[Sample], gen_s: float) -> dict[str, float]:
    n = len(samples)
    lens = [s.response_length for s in samples]
    rewards = [s.scalar_reward for s in samples]
    versions = [s.weight_version for s in samples]
    tokens = sum(lens)
    carried = sum(int(s.metadata.get(META_CARRIED, 0)) for s in samples)
    by_status = {st: sum(s.status == st for s in samples) for st in SampleStatus}
    return {
        "rollout/samples": float(n),
        "rollout/reward_mean": sum(rewards) / n,
        "rollout/response_len_mean": tokens / n,
        "rollout/response_len_max": float(max(lens)),
        "rollout/truncated_rate": by_status[SampleStatus.TRUNCATED] / n,
        "rollout/weight_version_min": float(min(versions)),
        "rollout/weight_version_max": float(max(versions)),
        "rollout/time/generate_s": gen_s,
        # tokens generated in this rollout (not the ones a partial sample carried in)
        "rollout/tokens_per_s": (tokens - carried) / gen_s if gen_s > 0 else 0.0,
        # partial rollout: samples continued from a hand-back, their carried tokens, and how
        # many of those --mask-offpolicy-in-partial-rollout took out of the loss
        "rollout/partial/continued_samples": float(sum(bool(s.metadata.get(META_CARRIED)) for s in samples)),
        "rollout/partial/carried_tokens": float(carried),
        "rollout/partial/masked_tokens": float(sum(int(s.metadata.get(META_MASKED, 0)) for s in samples)),
    }


def eval_metrics(name: str, groups: Sequence[list[Sample]], k: int) -> dict[str, float]:
    """Mean reward and pass@k (a prompt passes if any of its k samples has reward > 0)."""
    samples = [s for g in groups for s in g]
    if not samples:
        return {}
    rewards = [s.scalar_reward for s in samples]
    return {
        f"eval/{name}/reward_mean": sum(rewards) / len(rewards),
        f"eval/{name}/pass@{k}": sum(any(s.scalar_reward > 0 for s in g) for g in groups) / len(groups),
        f"eval/{name}/response_len_mean": sum(s.response_length for s in samples) / len(samples),
        f"eval/{name}/prompts": float(len(groups)),
    }


def _delta(now: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: now[k] - before.get(k, 0.0) for k in now}
