"""The contract between the rollout driver and a generate function.

The driver owns the engines (router client, retries, weight versions) and hands a
generate function a `GenerateContext`: one async `generate(input_ids, sampling_params)`
call that returns the new tokens with their logprobs. A generate function turns one
prompt into one `Generation`: the response tokens, which of them are trained
(`loss_mask`), their engine logprobs, and how it ended.

`default_generate` is the single-turn function. `--custom-generate-function-path`
names another one, e.g. a multi-turn tool-calling loop (examples/tool_calling/) that
appends tool output tokens with loss_mask 0 between model turns.

Fan-out (sub-agents, several agents per episode): a generate function decorated with
`@fan_out(k)` returns a list of exactly k Generations per call, each of which becomes a
sample of the prompt's group (in call order; `Sample.metadata["generate_call"]` says which
call, i.e. which episode, a sample came from). The driver then calls it
n_samples_per_prompt / k times per prompt, so a group still holds exactly
--n-samples-per-prompt samples and a rollout --rollout-batch-size x --n-samples-per-prompt:
the trainer's batch identity (= --global-batch-size x --num-steps-per-rollout) is unchanged,
and k must divide --n-samples-per-prompt (and --n-samples-per-eval-prompt), checked at
submit. Why a declared k and not "whatever comes back": every rollout must hold the same
number of samples (each optimizer step trains --global-batch-size of them), and the driver
has to know how many calls to make before the first one returns. Each generation is scored
on its own (its `reward`, or the reward function; a group reward function sees all of
them). An episode with fewer sub-agents than k must still return k Generations, e.g.
padding ones with an all-zero loss_mask (they count in the group's reward baseline).
A function without @fan_out may also return a list of one. Fan-out does not combine with
--partial-rollout (a handed-back group keeps one partial sample per sample, which a call
producing k of them cannot continue).

A function that accepts a `partial` keyword continues an aborted sample (partial
rollout) from its tokens so far; one that does not is restarted from scratch.

Partial rollout bookkeeping: a Generation keeps `version_runs`, the weight version of
every response token as run lengths ([count, version], env tokens at ENV_VERSION), so
a sample continued across weight updates knows which tokens which weights produced.
With --mask-offpolicy-in-partial-rollout, `mask_offpolicy()` takes the tokens of
versions older than the sample's newest one out of the loss when the group is done.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypedDict, runtime_checkable

from rlslurm.buffer.sample import Sample, SampleStatus
from rlslurm.errors import ConfigError, DataError
from rlslurm.plugins import load_callable
from rlslurm.rollout.data import PartialSample, Prompt
from rlslurm.rollout.rewards import RewardFn, RewardInput, check_reward, score_group

# version_runs entry of tokens the model did not generate (tool output, user turns)
ENV_VERSION = -1
# Sample.metadata keys written for continued samples (read back by filters._partials)
META_RUNS = "weight_version_runs"
META_CARRIED = "partial_tokens"
META_MASKED = "offpolicy_masked_tokens"
# Sample.metadata key of a fan-out sample: which call of the generate function made it
META_CALL = "generate_call"
# the attribute @fan_out sets on a generate function
FAN_OUT_ATTR = "rlslurm_fan_out"


class GenerateOutput(TypedDict):
    """One engine call's result (SGLang /generate, reduced to what training needs)."""

    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: int


@runtime_checkable
class GenerateContext(Protocol):
    """What a generate function may use: the engine call and the tokenizer."""

    tokenizer: Any  # an HF tokenizer (encode/decode); the driver's, so ids match the engine's

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any]) -> GenerateOutput: ...


_FINISH_STATUS = {
    "stop": SampleStatus.COMPLETED,
    "eos": SampleStatus.COMPLETED,
    "length": SampleStatus.TRUNCATED,
    "abort": SampleStatus.ABORTED,
}


def status_of(finish_reason: str) -> SampleStatus:
    try:
        return _FINISH_STATUS[finish_reason]
    except KeyError:
        raise DataError("engine reply", f"unknown finish_reason {finish_reason!r}") from None


@dataclass
class Generation:
    """One sample's response as it grows turn by turn.

    `weight_version` is the oldest weights that produced a trained token (staleness is
    measured from it). `reward` may be set by a generate function whose environment
    scores the episode itself; the driver's reward function then is not called.
    """

    response_ids: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    status: SampleStatus = SampleStatus.COMPLETED
    weight_version: int | None = None
    response_text: str | None = None
    reward: float | dict[str, float] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    version_runs: list[list[int]] = field(default_factory=list)  # [count, version] per run of tokens
    carried: int = 0  # tokens that came with the partial sample this one continues

    def __len__(self) -> int:
        return len(self.response_ids)

    def _add_run(self, n: int, version: int) -> None:
        if n <= 0:
            return
        if self.version_runs and self.version_runs[-1][1] == version:
            self.version_runs[-1][0] += n
        else:
            self.version_runs.append([n, version])

    def append_model(self, out: GenerateOutput) -> None:
        """Append an engine turn; its tokens are trained."""
        ids, lps = list(out["output_ids"]), list(out["output_logprobs"])
        if len(ids) != len(lps):
            raise DataError("engine reply", f"{len(ids)} output ids but {len(lps)} logprobs")
        self.response_ids += ids
        self.response_logprobs += [float(x) for x in lps]
        self.loss_mask += [1] * len(ids)
        self.status = status_of(out["finish_reason"])
        if ids:
            v = int(out["weight_version"])
            self.weight_version = v if self.weight_version is None else min(self.weight_version, v)
            self._add_run(len(ids), v)

    def append_env(self, ids: Sequence[int]) -> None:
        """Append tokens the model did not generate (tool output, user turn): not trained.

        Their logprob is 0.0 by convention; the mask keeps them out of every loss.
        """
        self.response_ids += [int(t) for t in ids]
        self.response_logprobs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)
        self._add_run(len(ids), ENV_VERSION)

    @property
    def finished(self) -> bool:
        return self.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)

    @classmethod
    def from_partial(cls, partial: PartialSample, *, mask_offpolicy: bool = False) -> "Generation":
        """Continue from an aborted sample. `mask_offpolicy` masks every carried token at
        once (slime's rule); the driver instead calls `mask_offpolicy()` when the sample is
        done, which masks only tokens of weights older than the ones that finished it."""
        return cls(
            response_ids=list(partial.output_ids),
            response_logprobs=list(partial.output_logprobs),
            loss_mask=[0] * len(partial.loss_mask) if mask_offpolicy else list(partial.loss_mask),
            status=SampleStatus(partial.status),
            weight_version=partial.weight_version if partial.output_ids else None,
            version_runs=[list(r) for r in partial.runs()],
            carried=len(partial.output_ids),
        )

    def to_partial(self) -> PartialSample:
        return PartialSample(output_ids=list(self.response_ids), output_logprobs=list(self.response_logprobs),
                             loss_mask=list(self.loss_mask), weight_version=self.weight_version or 0,
                             status=self.status.value, version_runs=self.token_runs())

    def token_runs(self) -> list[list[int]] | None:
        """`version_runs` if they cover the response (a custom generate function may have
        edited the token lists directly; then nothing per-token is known)."""
        if sum(n for n, _ in self.version_runs) != len(self.response_ids):
            return None
        return [list(r) for r in self.version_runs]

    def mask_offpolicy(self, where: str) -> int:
        """Take the tokens that weights older than this sample's newest generated out of
        the loss (--mask-offpolicy-in-partial-rollout); `weight_version` becomes the oldest
        version still trained. Returns how many trained tokens were masked."""
        runs = self.token_runs()
        if runs is None and not self.carried:
            return 0  # a fresh sample: nothing in it predates this rollout's requests
        if runs is None:
            raise DataError(where, f"the generate function left {len(self.response_ids)} response tokens but weight "
                                   f"versions for {sum(n for n, _ in self.version_runs)}: use Generation.append_model/"
                                   "append_env (needed by --mask-offpolicy-in-partial-rollout)")
        model = [v for _, v in runs if v != ENV_VERSION]
        if len(set(model)) < 2:
            return 0
        newest, masked, pos = max(model), 0, 0
        trained: set[int] = set()
        for n, v in runs:
            if v != ENV_VERSION and v < newest:
                masked += sum(self.loss_mask[pos:pos + n])
                self.loss_mask[pos:pos + n] = [0] * n
            elif v != ENV_VERSION and any(self.loss_mask[pos:pos + n]):
                trained.add(v)
            pos += n
        self.weight_version = min(trained) if trained else newest
        return masked

    def partial_metadata(self) -> dict[str, Any]:
        """What a continued sample records about its segments (empty for a fresh one)."""
        out: dict[str, Any] = {}
        if self.carried:
            out[META_CARRIED] = self.carried
        runs = self.token_runs()
        if runs is not None and len({v for _, v in runs if v != ENV_VERSION}) > 1:
            out[META_RUNS] = runs
        return out

    def to_sample(self, prompt_ids: Sequence[int], *, group_index: int = 0, index: int = 0,
                  label: Any = None, metadata: dict[str, Any] | None = None,
                  default_weight_version: int = 0) -> Sample:
        return Sample(
            prompt_tokens=list(prompt_ids),
            response_tokens=list(self.response_ids),
            reward=0.0 if self.reward is None else self.reward,
            loss_mask=list(self.loss_mask),
            rollout_logprobs=list(self.response_logprobs),
            status=self.status,
            group_index=group_index,
            index=index,
            weight_version=default_weight_version if self.weight_version is None else self.weight_version,
            label=None if label is None else str(label),
            metadata={**(metadata or {}), **self.partial_metadata(), **self.metadata},
        )


GenerateFn = Callable[..., Awaitable[Generation]]


def prompt_token_ids(ctx: GenerateContext, prompt: Prompt) -> list[int]:
    """The prompt's ids: from the data source, or tokenized here for a text prompt."""
    if prompt.prompt_ids is not None:
        return list(prompt.prompt_ids)
    if isinstance(prompt.prompt, str):
        return list(ctx.tokenizer(prompt.prompt, add_special_tokens=False)["input_ids"])
    raise DataError(prompt.where or f"prompt {prompt.index}",
                    "prompt is a message list: turn on --apply-chat-template or use a custom generate function")


def remaining_budget(gen: Generation, sampling_params: dict[str, Any]) -> int:
    """New tokens still allowed: max_new_tokens bounds the whole response, tool tokens included."""
    if "max_new_tokens" not in sampling_params:
        raise ConfigError("sampling_params needs max_new_tokens (--rollout-max-response-len)")
    return int(sampling_params["max_new_tokens"]) - len(gen)


async def default_generate(ctx: GenerateContext, prompt: Prompt, sampling_params: dict[str, Any], *,
                           partial: PartialSample | None = None) -> Generation:
    """One engine call; continues `partial` when given (partial rollout)."""
    gen = Generation.from_partial(partial) if partial is not None else Generation()
    if partial is not None and gen.finished:
        return gen  # finished before the abort: nothing left to generate
    budget = remaining_budget(gen, sampling_params)
    if budget <= 0:
        gen.status = SampleStatus.TRUNCATED
        return gen
    out = await ctx.generate(prompt_token_ids(ctx, prompt) + gen.response_ids,
                             {**sampling_params, "max_new_tokens": budget})
    gen.append_model(out)
    return gen


def accepts_partial(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "partial" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def fan_out(k: int) -> Callable[[GenerateFn], GenerateFn]:
    """Declare that a generate function returns a list of exactly `k` Generations per call
    (module docstring: Fan-out)."""
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ConfigError(f"@fan_out({k!r}): the number of Generations per call must be a whole number >= 1")

    def mark(fn: GenerateFn) -> GenerateFn:
        setattr(fn, FAN_OUT_ATTR, k)
        return fn

    return mark


def fan_out_of(fn: Callable[..., Any]) -> int:
    """How many Generations one call of `fn` returns (1 unless it is decorated with @fan_out)."""
    return int(getattr(fn, FAN_OUT_ATTR, 1))


def calls_per_group(fn: Callable[..., Any], n: int, n_flag: str) -> int:
    """How many calls of `fn` make a group of `n` samples; `n_flag` is the flag `n` came from."""
    k = fan_out_of(fn)
    if n % k:
        raise ConfigError(f"{n_flag} {n} is not a multiple of {_fn_name(fn)}'s @fan_out({k}): a group holds "
                          f"exactly {n_flag} samples, {k} per call")
    return n // k


def _fn_name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def load_generate_fn(spec: str | None) -> GenerateFn:
    """--custom-generate-function-path, or the default single-turn function."""
    if spec is None:
        return default_generate
    fn = load_callable(spec, what="--custom-generate-function-path", min_args=3)
    if not inspect.iscoroutinefunction(fn) and not inspect.iscoroutinefunction(getattr(fn, "__call__", None)):
        raise ConfigError(f"--custom-generate-function-path {spec!r}: must be an async function "
                          f"(async def f(ctx, prompt, sampling_params))")
    k = getattr(fn, FAN_OUT_ATTR, 1)
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ConfigError(f"--custom-generate-function-path {spec!r}: its fan-out {k!r} is not a whole number >= 1 "
                          "(use @rlslurm.rollout.generate_api.fan_out(k))")
    return fn


async def run_generate(fn: GenerateFn, ctx: GenerateContext, prompt: Prompt, sampling_params: dict[str, Any],
                       partial: PartialSample | None = None) -> Generation:
    """Call a generate function that returns one Generation (see `run_generate_call`)."""
    if fan_out_of(fn) != 1:
        raise ConfigError(f"{_fn_name(fn)} is @fan_out({fan_out_of(fn)}): call it with run_generate_call")
    return (await run_generate_call(fn, ctx, prompt, sampling_params, partial))[0]


async def run_generate_call(fn: GenerateFn, ctx: GenerateContext, prompt: Prompt, sampling_params: dict[str, Any],
                            partial: PartialSample | None = None) -> list[Generation]:
    """Call a generate function, passing `partial` only to functions that take it. Returns its
    Generations: one, or @fan_out's k."""
    if partial is not None and accepts_partial(fn):
        got = await fn(ctx, prompt, dict(sampling_params), partial=partial)
    else:
        got = await fn(ctx, prompt, dict(sampling_params))
    gens = _as_generations(got, fn, prompt)
    where = prompt.where or f"prompt {prompt.index}"
    for gen in gens:
        n = len(gen.response_ids)
        if len(gen.loss_mask) != n or len(gen.response_logprobs) != n:
            raise DataError(where, f"generate function {_fn_name(fn)} returned {n} tokens but "
                                   f"{len(gen.loss_mask)} mask entries and {len(gen.response_logprobs)} logprobs")
    return gens


def _as_generations(got: Any, fn: GenerateFn, prompt: Prompt) -> list[Generation]:
    """`got` as the list of Generations the function promised (one, or @fan_out's k)."""
    k = fan_out_of(fn)
    name, where = _fn_name(fn), prompt.where or f"prompt {prompt.index}"
    if isinstance(got, Generation) and k == 1:
        return [got]
    if isinstance(got, (list, tuple)) and got and all(isinstance(g, Generation) for g in got):
        if len(got) == k:
            return list(got)
        if k == 1:
            raise DataError(where, f"--custom-generate-function-path {name} returned {len(got)} Generations in one "
                                   f"call: declare it with @rlslurm.rollout.generate_api.fan_out({len(got)}) (then "
                                   f"--n-samples-per-prompt counts them) or return one")
        raise DataError(where, f"--custom-generate-function-path {name} is @fan_out({k}) but returned {len(got)} "
                               f"Generations in one call; every call must return exactly {k} (each rollout holds "
                               "--rollout-batch-size x --n-samples-per-prompt samples)")
    shown = f"a {type(got).__name__}" if not isinstance(got, (list, tuple)) else \
        f"a list of {', '.join(sorted({type(g).__name__ for g in got})) or 'nothing'}"
    want = "a rlslurm.rollout.generate_api.Generation" if k == 1 else f"a list of {k} Generations (@fan_out({k}))"
    raise ConfigError(f"--custom-generate-function-path {name} returned {shown}; expected {want}")


def with_context_cap(sampling_params: dict[str, Any], prompt_len: int, max_context_len: int | None,
                     where: str) -> dict[str, Any]:
    """`sampling_params` with max_new_tokens cut so that prompt + response fit `max_context_len`
    (slime's --rollout-max-context-len). The response budget bounds tool tokens too
    (`remaining_budget`), so a multi-turn generate function stays inside the cap as well."""
    if max_context_len is None:
        return sampling_params
    room = max_context_len - prompt_len
    if room < 1:
        raise DataError(where, f"the prompt is {prompt_len} tokens, which leaves no room for a response within "
                               f"--rollout-max-context-len {max_context_len} (training prompts longer than "
                               f"{max_context_len - 1} tokens are dropped; this one came from another source)")
    return {**sampling_params, "max_new_tokens": min(int(sampling_params["max_new_tokens"]), room)}


async def generate_group(ctx: GenerateContext, prompt: Prompt, *, n: int, sampling_params: dict[str, Any],
                         reward_fn: RewardFn, generate_fn: GenerateFn = default_generate,
                         reward_key: str | None = None, reward_executor: Any = None,
                         seed_per_sample: bool = False, mask_offpolicy: bool = False,
                         max_context_len: int | None = None, skip_special_tokens: bool = True,
                         n_flag: str = "--n-samples-per-prompt") -> list[Sample]:
    """Generate and score one prompt's group of `n` samples (the usual `run_group`).

    Samples continue `prompt.partial` when it is set. If any sample was aborted the group
    is returned unscored: it goes back to the prompt source and is scored when complete
    (a group reward needs the whole group). A Generation that carries its own reward
    (an environment that scored the episode) is not re-scored. `group_index`/`index` are
    the prompt's record number and the sample's place in the group; the driver
    renumbers them by position in the rollout. `seed_per_sample` sets
    `sampling_seed` = k (the call) so that the calls differ under deterministic inference.
    `mask_offpolicy` (partial rollout) masks each finished sample's tokens that older
    weights generated; it is applied only once the whole group is done, because a
    continued segment may still come from newer weights. `max_context_len`
    (--rollout-max-context-len) caps prompt + response tokens: the response budget
    (`max_new_tokens`) shrinks to what the prompt leaves. `skip_special_tokens`
    (--rollout-skip-special-tokens): how the response is decoded for the reward.
    A @fan_out(k) generate function is called n / k times (`n_flag` names the flag of `n`
    in the error when k does not divide it).
    """
    calls = calls_per_group(generate_fn, n, n_flag)
    where = prompt.where or f"prompt {prompt.index}"
    if prompt.partial is not None and calls != n:
        raise ConfigError(f"{where}: handed back with partial samples, but --custom-generate-function-path "
                          f"{_fn_name(generate_fn)} fans out (@fan_out): "
                          "fan-out does not combine with --partial-rollout")
    partials: Sequence[PartialSample | None] = prompt.partial or [None] * n
    if len(partials) != n:
        raise DataError(where, f"handed back with {len(partials)} partial samples but n_samples_per_prompt is {n}")

    prompt_ids = prompt_token_ids(ctx, prompt)
    sampling_params = with_context_cap(sampling_params, len(prompt_ids), max_context_len, where)

    def params(k: int) -> dict[str, Any]:
        return {**sampling_params, "sampling_seed": k} if seed_per_sample else dict(sampling_params)

    per_call = await asyncio.gather(*(run_generate_call(generate_fn, ctx, prompt, params(c), partials[c])
                                      for c in range(calls)))
    gens = [g for got in per_call for g in got]
    for c, got in enumerate(per_call):
        if calls != n:  # fan-out: which call (episode) each sample came from
            for g in got:
                g.metadata.setdefault(META_CALL, c)
    return await score_generations(ctx, prompt, gens, reward_fn=reward_fn, prompt_ids=prompt_ids,
                                   reward_key=reward_key, reward_executor=reward_executor,
                                   mask_offpolicy=mask_offpolicy, skip_special_tokens=skip_special_tokens)


async def score_generations(ctx: GenerateContext, prompt: Prompt, gens: Sequence[Generation], *,
                            reward_fn: RewardFn, prompt_ids: Sequence[int] | None = None,
                            reward_key: str | None = None, reward_executor: Any = None,
                            mask_offpolicy: bool = False, skip_special_tokens: bool = True) -> list[Sample]:
    """One prompt's Generations as its group of Samples, scored (see `generate_group`); also what
    the driver does with the Generation groups a --rollout-function-path function returns."""
    where = prompt.where or f"prompt {prompt.index}"
    if prompt_ids is None:
        prompt_ids = prompt_token_ids(ctx, prompt)
    aborted = any(g.status == SampleStatus.ABORTED for g in gens)
    if mask_offpolicy and not aborted:
        for k, g in enumerate(gens):
            masked = g.mask_offpolicy(f"{where} sample {k}")
            if masked:
                g.metadata[META_MASKED] = masked
    samples = [g.to_sample(prompt_ids, group_index=prompt.index, index=k, label=prompt.label,
                           metadata=prompt.metadata) for k, g in enumerate(gens)]
    for s in samples:
        s.reward_key = reward_key
    if aborted:
        return samples
    for k, g in enumerate(gens):
        if g.reward is not None:  # the generate function's own score: checked like a reward function's
            samples[k].reward = check_reward(g.reward, reward_key=reward_key, name="generate function reward",
                                             where=f"{where} #{k}")
    todo = [k for k, g in enumerate(gens) if g.reward is None]
    if todo:
        items = [RewardInput(prompt=prompt.prompt, label=prompt.label, metadata=prompt.metadata,
                             response=ctx.tokenizer.decode(gens[k].response_ids,
                                                             skip_special_tokens=skip_special_tokens),
                             response_ids=list(gens[k].response_ids), status=gens[k].status.value,
                             where=prompt.where) for k in todo]
        rewards = await score_group(items, reward_fn, reward_key=reward_key, executor=reward_executor)
        for k, r in zip(todo, rewards):
            samples[k].reward = r
    return samples
