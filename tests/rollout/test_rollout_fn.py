"""Agent hooks (issue 16 item 5): --rollout-function-path (rollout/rollout_fn.py) and fan-out generate
functions (@fan_out, rollout/generate_api.py).

Fast tests check the shape rules and refusals on real prompt sources; the one server test runs the
real driver on the real CPU SGLang engines of `private_deployment` (shared with test_driver.py and
test_partial_rollout.py) with both hooks written into tmp_path, and reads the committed rollouts
back with RolloutReader.
"""

from __future__ import annotations

import asyncio
import textwrap

import pytest

from rlslurm.buffer.reader import RolloutReader
from rlslurm.buffer.sample import Sample, SampleStatus
from rlslurm.errors import ConfigError, DataError
from rlslurm.plugins import load_object
from rlslurm.rollout.data import Prompt, PromptSource
from rlslurm.rollout.generate_api import (
    META_CALL,
    GenerateOutput,
    Generation,
    calls_per_group,
    fan_out,
    generate_group,
    run_generate,
)
from rlslurm.rollout.rewards import RewardFn
from rlslurm.rollout.rollout_fn import (
    RolloutOutput,
    TrackedSource,
    call_rollout_fn,
    check_output,
    load_rollout_fn,
)
from tests.rollout.helpers import make_cfg, make_driver, metrics_lines, write_prompts

# --- no servers ------------------------------------------------------------------------------


def _sample(status=SampleStatus.COMPLETED) -> Sample:
    return Sample(prompt_tokens=[1], response_tokens=[2], status=status)


def _prompt(i: int) -> Prompt:
    return Prompt(index=i, epoch=0, prompt="say a", prompt_ids=[1, 2], label="a", where=f"p.jsonl:{i + 1}")


def _check(out, *, ran_out=False):
    return check_output(out, spec="r.py:roll", rollout_id=3, rollout_batch_size=2, n_samples_per_prompt=2,
                        ran_out=ran_out)


@pytest.mark.parametrize("out, says", [
    ([[_sample(), _sample()]] * 2, "returned list; expected RolloutOutput(groups, prompts)"),
    (RolloutOutput([[_sample(), _sample()]], [_prompt(0)]), "returned 1 groups; --rollout-batch-size is 2"),
    (RolloutOutput([[_sample()]] * 2, [_prompt(0), _prompt(1)]),
     "group 0 (p.jsonl:1) has 1 samples; --n-samples-per-prompt is 2"),
    (RolloutOutput([[_sample(), _sample()]] * 2, [_prompt(0)]), "returned 2 groups but 1 prompts"),
    (RolloutOutput([[_sample(), Generation()]] * 2, [_prompt(0), _prompt(1)]),
     "group 0 is a list of Generation, Sample; expected a list of Samples or of Generations"),
    (RolloutOutput([[_sample(), _sample(SampleStatus.ABORTED)]] * 2, [_prompt(0), _prompt(1)]),
     "group 0 sample 1 is aborted; hand its prompt back"),
    (RolloutOutput([[_sample(), _sample()]] * 2, [_prompt(0), _prompt(1)], {"x": "high"}),
     "metrics that are not a dict of numbers"),
])
def test_a_rollout_of_the_wrong_shape_is_one_line_naming_the_flag(out, says):
    with pytest.raises(ConfigError) as e:
        _check(out)
    msg = str(e.value)
    assert msg.startswith("--rollout-function-path r.py:roll (rollout 3)") and says in msg and "\n" not in msg, msg


def test_fewer_groups_only_when_the_source_ran_out():
    short = RolloutOutput([[_sample(), _sample()]], [_prompt(0)])
    assert _check(short, ran_out=True).exhausted
    full = RolloutOutput([[Generation(), Generation()]] * 2, [_prompt(0), _prompt(1)], {"custom/x": 1})
    got = _check(full, ran_out=True)
    assert not got.exhausted and got.metrics == {"custom/x": 1}


def test_tracked_source_hands_back_what_a_cancelled_function_held(tmp_path):
    src = PromptSource(write_prompts(tmp_path / "p.jsonl", 6), shuffle=False)
    tracked = TrackedSource(src)
    started = asyncio.Event()

    async def roll(ctx):
        first = ctx.source.take(3)
        ctx.source.push_back(first[0])       # the function's own hand-back
        ctx.source.take(1)                   # ... served again at once
        started.set()
        await asyncio.sleep(60)

    aborted = []

    class Ctx:
        source = tracked

        @staticmethod
        async def abort():
            aborted.append(True)

    async def go():
        task = asyncio.ensure_future(call_rollout_fn(roll, Ctx()))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    assert aborted == [True]  # the engine requests it left running are stopped too
    assert (tracked.taken, tracked.ran_out) == (4, False)
    # the three prompts still out went back: the next take serves them, then the file goes on
    assert [p.index for p in src.take(4)] == [1, 2, 0, 3]
    assert tracked.state_dict() == src.state_dict()  # everything else is the source's own
    tracked.take(10)
    assert tracked.ran_out


def test_rollout_function_must_be_async_with_one_argument(tmp_path):
    plugin = tmp_path / "roll.py"
    plugin.write_text("async def roll(ctx):\n    pass\ndef blocking(ctx):\n    pass\nasync def none():\n    pass\n")
    assert load_rollout_fn(f"{plugin}:roll").__name__ == "roll"
    with pytest.raises(ConfigError, match="--rollout-function-path .*must be an async function"):
        load_rollout_fn(f"{plugin}:blocking")
    with pytest.raises(ConfigError, match="--rollout-function-path .*cannot be called with 1 positional"):
        load_rollout_fn(f"{plugin}:none")


class Echo:
    """A GenerateContext stand-in: answers the call's sampling_seed as one token; records calls."""

    class tokenizer:  # noqa: N801 - what the reward decodes with
        @staticmethod
        def decode(ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    def __init__(self) -> None:
        self.calls = 0

    async def generate(self, input_ids, sampling_params) -> GenerateOutput:
        self.calls += 1
        return GenerateOutput(output_ids=[sampling_params.get("sampling_seed", 0)], output_logprobs=[-0.1],
                              finish_reason="stop", weight_version=0)


@fan_out(2)
async def planner_and_solver(ctx, prompt, sampling_params):
    plan = Generation(metadata={"agent": "planner"})
    plan.append_model(await ctx.generate(prompt.prompt_ids, sampling_params))
    solve = Generation(metadata={"agent": "solver"})
    solve.append_model(await ctx.generate(prompt.prompt_ids + plan.response_ids, sampling_params))
    return [plan, solve]


def test_fan_out_calls_n_over_k_times_and_each_generation_is_a_sample():
    engine = Echo()
    group = asyncio.run(generate_group(engine, _prompt(0), n=4, sampling_params={"max_new_tokens": 4},
                                       reward_fn=RewardFn(lambda item: float(item.response == "1")),
                                       generate_fn=planner_and_solver, seed_per_sample=True))
    assert engine.calls == 4 and len(group) == 4  # 2 calls x 2 generations (each makes 2 engine requests)
    assert [s.metadata[META_CALL] for s in group] == [0, 0, 1, 1]
    assert [s.metadata["agent"] for s in group] == ["planner", "solver"] * 2
    assert [s.reward for s in group] == [0.0, 0.0, 1.0, 1.0]  # each generation scored on its own
    with pytest.raises(ConfigError, match=r"--n-samples-per-eval-prompt 3 is not a multiple of "
                                          r"planner_and_solver's @fan_out\(2\)"):
        calls_per_group(planner_and_solver, 3, "--n-samples-per-eval-prompt")
    with pytest.raises(ConfigError, match="fan-out does not combine with --partial-rollout"):
        p = _prompt(0)
        p.partial = [None] * 4  # type: ignore[list-item]
        asyncio.run(generate_group(engine, p, n=4, sampling_params={"max_new_tokens": 4},
                                   reward_fn=RewardFn(lambda item: 0.0), generate_fn=planner_and_solver))
    with pytest.raises(ConfigError, match="@fan_out"):
        asyncio.run(run_generate(planner_and_solver, engine, _prompt(0), {"max_new_tokens": 4}))


def test_a_generate_function_returning_another_count_is_named():
    @fan_out(3)
    async def three_said_two(ctx, prompt, sampling_params):
        return [Generation(), Generation()]

    async def undeclared(ctx, prompt, sampling_params):
        return [Generation(), Generation()]

    async def text(ctx, prompt, sampling_params):
        return "an answer"

    async def nothing(ctx, prompt, sampling_params):
        return []

    def group(fn, n):
        return asyncio.run(generate_group(Echo(), _prompt(0), n=n, sampling_params={"max_new_tokens": 4},
                                          reward_fn=RewardFn(lambda item: 0.0), generate_fn=fn))

    with pytest.raises(DataError, match=r"p.jsonl:1.*three_said_two is @fan_out\(3\) but returned 2 Generations"):
        group(three_said_two, 3)
    with pytest.raises(DataError, match=r"undeclared returned 2 Generations in one call: declare it with "
                                        r"@rlslurm.rollout.generate_api.fan_out\(2\)"):
        group(undeclared, 2)
    with pytest.raises(ConfigError, match="text returned a str; expected a rlslurm.rollout.generate_api.Generation"):
        group(text, 1)
    with pytest.raises(ConfigError, match="nothing returned a list of nothing; expected a rlslurm"):
        group(nothing, 1)
    with pytest.raises(ConfigError, match="whole number"):
        fan_out(0)


# --- real servers ----------------------------------------------------------------------------

ROLLOUT_FN = '''
from rlslurm.rollout.generate_api import Generation, prompt_token_ids
from rlslurm.rollout.rollout_fn import RolloutOutput


async def half_and_half(ctx):
    """Half the groups through the driver's own run_group, half as Generations made here; one extra
    prompt is taken and handed back each rollout (served first in the next)."""
    r = ctx.rollout
    prompts = ctx.source.take(r.rollout_batch_size + 1)
    ctx.source.push_back(prompts.pop())
    groups = []
    for i, prompt in enumerate(prompts):
        if i % 2 == 0:
            groups.append(await ctx.run_group(prompt))
            continue
        gens = []
        for k in range(r.n_samples_per_prompt):
            g = Generation(metadata={"made_by": "rollout_fn"})
            g.append_model(await ctx.engine.generate(prompt_token_ids(ctx.engine, prompt), ctx.sampling_params))
            gens.append(g)
        groups.append(gens)
    return RolloutOutput(groups=groups, prompts=prompts,
                         metrics={"custom/rollout_id": float(ctx.rollout_id), "custom/version": ctx.weight_version})
'''

STOPPED_FN = '''
import asyncio

STATE = {}


async def holds_prompts(ctx):
    """Takes a rollout's prompts and is still working on them when the driver is stopped."""
    STATE["taken"] = [(p.epoch, p.index) for p in ctx.source.take(ctx.rollout.rollout_batch_size)]
    await asyncio.sleep(120)
'''

FAN_OUT_FN = '''
from rlslurm.rollout.generate_api import Generation, fan_out, prompt_token_ids


@fan_out(2)
async def two_agents(ctx, prompt, sampling_params):
    """A proposer answers the prompt, a checker continues after the proposer's answer."""
    ids = prompt_token_ids(ctx, prompt)
    proposer = Generation(metadata={"agent": "proposer"})
    proposer.append_model(await ctx.generate(ids, sampling_params))
    checker = Generation(metadata={"agent": "checker"})
    checker.append_model(await ctx.generate(ids + proposer.response_ids, sampling_params))
    return [proposer, checker]
'''


@pytest.mark.sglang
@pytest.mark.slow
def test_rollout_function_and_fan_out_commit_rollouts_on_real_engines(private_deployment, tmp_path):
    dep = private_deployment
    plugin = tmp_path / "hooks.py"
    plugin.write_text(textwrap.dedent(ROLLOUT_FN) + textwrap.dedent(FAN_OUT_FN) + textwrap.dedent(STOPPED_FN))

    # --rollout-function-path: two rollouts of 4 groups x 4 samples (async_buffer_size 1: rollout 1 may
    # use version 0 too, as no trainer publishes here)
    run = tmp_path / "run-fn"
    cfg = make_cfg(write_prompts(tmp_path / "p.jsonl", 12), num_rollout=2, async_buffer_size=1,
                   rollout_function_path=f"{plugin}:half_and_half")
    result = asyncio.run(make_driver(dep, cfg, run).run())
    assert result.reason == "done" and result.committed == [0, 1]
    reader = RolloutReader(run)
    served = []
    for rid in (0, 1):
        rollout = reader.read(rid)
        samples = rollout.samples
        assert len(samples) == 16 and [s.group_index for s in samples] == [g for g in range(4) for _ in range(4)]
        made_here = [s.metadata.get("made_by") == "rollout_fn" for s in samples]
        assert made_here == [False] * 4 + [True] * 4 + [False] * 4 + [True] * 4
        for s in samples:
            assert s.response_length > 0 and s.rollout_logprobs is not None
            assert s.reward in (0.0, 1.0) and s.status != SampleStatus.ABORTED
        served += [(s.metadata["prompt_epoch"], s.metadata["prompt_index"]) for s in samples[::4]]
        # the extra prompt was handed back: it is pending in the cursor, not used up
        assert len(rollout.meta.data_cursor["pending"]) == 1
    assert len(set(served)) == 8  # no prompt served twice
    lines = [m for m in metrics_lines(run) if m["kind"] == "train"]
    assert [m["custom/rollout_id"] for m in lines] == [0.0, 1.0]
    assert [m["rollout/function/prompts_taken"] for m in lines] == [5.0, 5.0]
    assert all(m["rollout/samples"] == 16.0 for m in lines)

    # a stop while the function holds its prompts: cancelled, the prompts go back with the saved cursor,
    # and the next driver (the function above) generates rollout 0 from exactly those
    run = tmp_path / "run-stop"
    prompts = write_prompts(tmp_path / "s.jsonl", 8)
    state = load_object(f"{plugin}:STATE")
    stopped = make_driver(dep, make_cfg(prompts, rollout_function_path=f"{plugin}:holds_prompts"), run)
    result = asyncio.run(stopped.run(should_stop=lambda: "taken" in state))
    assert result.reason == "stopped" and result.committed == [] and result.handback is not None
    resumed = make_driver(dep, make_cfg(prompts, rollout_function_path=f"{plugin}:half_and_half"), run)
    assert asyncio.run(resumed.run()).committed == [0]
    samples = RolloutReader(run).read(0).samples
    assert [(s.metadata["prompt_epoch"], s.metadata["prompt_index"]) for s in samples[::4]] == state["taken"]

    # a @fan_out(2) generate function through the driver's own loop: 2 calls per group of 4
    run = tmp_path / "run-fan"
    cfg = make_cfg(write_prompts(tmp_path / "q.jsonl", 8), custom_generate_function_path=f"{plugin}:two_agents")
    driver = make_driver(dep, cfg, run)
    result = asyncio.run(driver.run())
    assert result.reason == "done" and result.committed == [0]
    samples = RolloutReader(run).read(0).samples
    assert len(samples) == 16
    for g in range(4):
        group = samples[4 * g: 4 * g + 4]
        assert [s.group_index for s in group] == [g] * 4
        assert [s.metadata[META_CALL] for s in group] == [0, 0, 1, 1]
        assert [s.metadata["agent"] for s in group] == ["proposer", "checker"] * 2
        assert len({tuple(s.prompt_tokens) for s in group}) == 1  # every sample is stored with the group's prompt
    # two requests per call, two calls per group, four groups
    assert metrics_lines(run)[-1]["rollout/engine/requests"] == 16.0
