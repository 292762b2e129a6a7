"""Dynamic sampling, over-sampling, custom filters and partial rollout through GroupCollector."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from rlslurm.buffer.sample import Sample, SampleStatus
from rlslurm.errors import ConfigError
from rlslurm.rollout.data import PromptSource
from rlslurm.rollout.filters import (
    DynamicSamplingStalled,
    FilterResult,
    GroupCollector,
    dynamic_sampling_zero_std,
    load_filter,
    zero_std_filter,
)
from rlslurm.rollout.generate_api import GenerateOutput, Generation, default_generate, run_generate

N_PER_PROMPT = 4
MAX_NEW = 6


def sample(reward, status=SampleStatus.COMPLETED, **kw) -> Sample:
    return Sample(prompt_tokens=[1], response_tokens=[2, 3], reward=reward, status=status,
                  rollout_logprobs=[-0.1, -0.2], **kw)


def test_zero_std_filter_semantics():
    assert dynamic_sampling_zero_std([sample(0.0), sample(1.0)])
    assert not dynamic_sampling_zero_std([sample(1.0)] * 3)
    assert not dynamic_sampling_zero_std([sample(0.5)])  # one sample has no spread
    assert not dynamic_sampling_zero_std([sample(0.3), sample(0.3 + 1e-9)])
    assert zero_std_filter([sample(1.0)] * 2) == FilterResult(False, "zero_std_1")
    assert zero_std_filter([sample(0.0)] * 2) == FilterResult(False, "zero_std_0")
    dict_group = [sample({"acc": 1.0, "len": 3.0}, reward_key="acc"),
                  sample({"acc": 1.0, "len": 5.0}, reward_key="acc")]
    assert not dynamic_sampling_zero_std(dict_group)  # judged on the trained key, not "len"


class Engine:
    """A deterministic in-process GenerateContext: token t of a response is a function of
    the prompt and t; one token per event-loop turn; `aborted` makes in-flight calls stop."""

    tokenizer = None

    def __init__(self, delay_per_token: float = 0.0, stall_after: int | None = None, stall_s: float | None = None):
        self.delay = delay_per_token
        self.stall_after = stall_after  # hang after this many tokens until aborted (or stall_s passed)
        self.stall_s = stall_s
        self.weight_version = 0
        self._abort = asyncio.Event()

    @property
    def aborted(self) -> bool:
        return self._abort.is_set()

    def abort(self) -> None:
        self._abort.set()

    async def generate(self, input_ids, sampling_params) -> GenerateOutput:
        out: list[int] = []
        for _ in range(sampling_params["max_new_tokens"]):
            if self.stall_after is not None and len(out) >= self.stall_after:
                try:
                    await asyncio.wait_for(self._abort.wait(), self.stall_s)
                except asyncio.TimeoutError:
                    pass
            if self.aborted:
                return GenerateOutput(output_ids=out, output_logprobs=[-1.0] * len(out), finish_reason="abort",
                                      weight_version=self.weight_version)
            await asyncio.sleep(self.delay)
            out.append(10 + (sum(input_ids) + len(input_ids) + len(out)) % 50)
        return GenerateOutput(output_ids=out, output_logprobs=[-1.0] * len(out), finish_reason="length",
                              weight_version=self.weight_version)


def reward_of(label: str, k: int) -> float:
    # "all1": solved by every sample, "all0": by none, "mixed": by half
    return {"all1": 1.0, "all0": 0.0, "mixed": float(k % 2)}[label]


def make_runner(engine: Engine, *, delays: dict[int, float] | None = None, seen: list | None = None):
    async def run_group(prompt) -> list[Sample]:
        if seen is not None:
            seen.append((prompt.uid, prompt.partial is not None))
        await asyncio.sleep((delays or {}).get(prompt.index, 0.0))
        async def one(k: int) -> Sample:
            partial = prompt.partial[k] if prompt.partial else None
            gen = await run_generate(default_generate, engine, prompt, {"max_new_tokens": MAX_NEW}, partial)
            s = gen.to_sample(prompt.prompt_ids, group_index=prompt.index, index=k, label=prompt.label)
            if gen.finished:
                s.reward = reward_of(prompt.label, k)
            return s

        return list(await asyncio.gather(*(one(k) for k in range(N_PER_PROMPT))))

    return run_group


def write_prompts(path: Path, labels: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "label": lab}) + "\n" for i, lab in enumerate(labels)))
    return path


def source(path, **kw) -> PromptSource:
    # prompt ids are given by the data (no tokenizer needed): a message prompt's ids would need one
    src = PromptSource(path, shuffle=False, **kw)
    orig = src._build

    def build(record, epoch):
        p = orig(record, epoch)
        if p is not None:
            p.prompt_ids = [100 + record]
        return p

    src._build = build  # type: ignore[method-assign]
    return src


def test_dynamic_sampling_drops_zero_std_and_oversamples_to_fill(tmp_path):
    labels = ["all1", "mixed", "all0", "mixed", "all1", "all1", "mixed", "mixed", "all0", "mixed", "mixed", "mixed"]
    src = source(write_prompts(tmp_path / "d.jsonl", labels))
    coll = GroupCollector(src, make_runner(Engine()), rollout_batch_size=4, over_sampling_batch_size=3,
                          filters=[zero_std_filter])
    out = asyncio.run(coll.collect())
    assert [p.index for p in out.prompts] == [1, 3, 6, 7]
    assert all(len(g) == N_PER_PROMPT and len({s.scalar_reward for s in g}) == 2 for g in out.groups)
    m = out.metrics
    assert m["rollout/filter/drop_zero_std_1"] == 3 and m["rollout/filter/drop_zero_std_0"] == 1
    assert m["rollout/filter/groups_kept"] == 4 and m["rollout/filter/groups_dropped"] == 4
    # drawn in chunks of 3 until the batch could fill: 9 drawn, prompt 8 was in flight when it did
    assert m["rollout/filter/groups_drawn"] == 9 and m["rollout/filter/groups_returned"] == 1
    assert not out.exhausted
    # nothing drawn was lost: the unused prompt comes first in the next rollout
    assert [p.index for p in src.take(2)] == [8, 9]


def test_without_filters_every_group_is_kept_in_draw_order(tmp_path):
    src = source(write_prompts(tmp_path / "d.jsonl", ["all1"] * 5))
    # later prompts finish first; the batch is still in draw order
    runner = make_runner(Engine(), delays={0: 0.05, 1: 0.03, 2: 0.0})
    out = asyncio.run(GroupCollector(src, runner, rollout_batch_size=3).collect())
    assert [p.index for p in out.prompts] == [0, 1, 2]
    assert out.metrics["rollout/filter/groups_drawn"] == 3 and out.metrics["rollout/filter/keep_rate"] == 1.0


def test_source_running_out_returns_a_short_batch(tmp_path):
    src = source(write_prompts(tmp_path / "d.jsonl", ["mixed", "all1", "mixed"]))
    out = asyncio.run(GroupCollector(src, make_runner(Engine()), rollout_batch_size=4, over_sampling_batch_size=2,
                                     filters=[dynamic_sampling_zero_std]).collect())
    assert out.exhausted and [p.index for p in out.prompts] == [0, 2]
    assert out.metrics["rollout/filter/drop_dynamic_sampling_zero_std"] == 1  # named after a bool filter


def test_max_groups_stops_a_hopeless_rollout(tmp_path):
    src = source(write_prompts(tmp_path / "d.jsonl", ["all0"] * 30))
    coll = GroupCollector(src, make_runner(Engine()), rollout_batch_size=2, filters=[zero_std_filter], max_groups=6)
    with pytest.raises(DynamicSamplingStalled, match=r"drew 6 groups .*kept only 0 of 2.*zero_std_0"):
        asyncio.run(coll.collect())


def test_custom_filter_from_file(tmp_path):
    plugin = tmp_path / "filt.py"
    plugin.write_text(
        "from rlslurm.rollout.filters import FilterResult\n"
        "def no_truncated(group):\n"
        "    bad = sum(s.status.value == 'truncated' for s in group)\n"
        "    return FilterResult(bad == 0, 'truncated')\n"
        "def not_bool(group):\n"
        "    return 1\n"
    )
    src = source(write_prompts(tmp_path / "d.jsonl", ["mixed"] * 4))
    filt = load_filter(f"{plugin}:no_truncated")
    # every response hits max_new_tokens in this engine, so every group is dropped
    out = asyncio.run(GroupCollector(src, make_runner(Engine()), rollout_batch_size=2, filters=[filt]).collect())
    assert out.groups == [] and out.metrics["rollout/filter/drop_truncated"] == 4 and out.exhausted
    src = source(write_prompts(tmp_path / "e.jsonl", ["mixed"] * 4))
    with pytest.raises(ConfigError, match="group filter not_bool returned int"):
        asyncio.run(GroupCollector(src, make_runner(Engine()), rollout_batch_size=1,
                                   filters=[load_filter(f"{plugin}:not_bool")]).collect())
    with pytest.raises(ConfigError, match="--dynamic-sampling-filter-path .*has no attribute 'nope'"):
        load_filter(f"{plugin}:nope")


def test_bad_batch_flags(tmp_path):
    src = source(write_prompts(tmp_path / "d.jsonl", ["mixed"]))
    with pytest.raises(ConfigError, match="--rollout-batch-size"):
        GroupCollector(src, make_runner(Engine()), rollout_batch_size=0)
    with pytest.raises(ConfigError, match="--over-sampling-batch-size"):
        GroupCollector(src, make_runner(Engine()), rollout_batch_size=1, over_sampling_batch_size=0)


def test_partial_rollout_returns_unfinished_groups_with_their_tokens(tmp_path):
    labels = ["mixed"] * 6
    path = write_prompts(tmp_path / "d.jsonl", labels)
    engine = Engine()
    seen: list = []
    runner = make_runner(engine, seen=seen)
    # prompts 2 and 3 hang after 2 tokens: still generating when prompts 0, 1 fill the batch
    slow_engine = Engine(stall_after=2)

    async def run_group(prompt):
        if prompt.index in (2, 3) and prompt.partial is None:
            return await make_runner(slow_engine, seen=seen)(prompt)
        return await runner(prompt)

    async def abort():
        slow_engine.abort()

    src = source(path)
    coll = GroupCollector(src, run_group, rollout_batch_size=2, over_sampling_batch_size=4, partial_rollout=True,
                          abort=abort)
    first = asyncio.run(coll.collect())
    assert [p.index for p in first.prompts] == [0, 1]
    assert first.metrics["rollout/filter/groups_returned"] == 2
    state = json.loads(json.dumps(src.state_dict()))  # committed with rollout 0
    pending = state["pending"]
    assert [p["index"] for p in pending] == [2, 3]
    partial_lens = [len(ps["output_ids"]) for ps in pending[0]["partial"]]
    assert partial_lens == [2] * N_PER_PROMPT  # aborted mid-way, tokens kept

    # "restart": a fresh source from the committed cursor continues the partial groups
    src2 = source(path)
    src2.load_state_dict(state)
    engine2 = Engine()
    second = asyncio.run(GroupCollector(src2, make_runner(engine2, seen=seen), rollout_batch_size=2).collect())
    assert [p.index for p in second.prompts] == [2, 3]
    assert ((0, 2), True) in seen and ((0, 3), True) in seen  # served again with their partial tokens
    for prompt, group in zip(second.prompts, second.groups):
        for k, s in enumerate(group):
            before = pending[[2, 3].index(prompt.index)]["partial"][k]["output_ids"]
            assert list(s.response_tokens[: len(before)]) == before  # prefix kept, not regenerated
            assert s.response_length == MAX_NEW and s.status == SampleStatus.TRUNCATED
    third = asyncio.run(GroupCollector(src2, make_runner(engine2), rollout_batch_size=4).collect())
    assert [p.index for p in third.prompts] == [4, 5] and third.exhausted
    used = [p.index for r in (first, second, third) for p in r.prompts]
    assert sorted(used) == list(range(6))  # nothing skipped, nothing repeated


def test_without_partial_rollout_unfinished_prompts_restart_from_scratch(tmp_path):
    src = source(write_prompts(tmp_path / "d.jsonl", ["mixed"] * 4))
    slow = Engine(stall_after=1)

    async def run_group(prompt):
        eng = slow if prompt.index == 1 else Engine()
        return await make_runner(eng)(prompt)

    async def abort():
        slow.abort()

    out = asyncio.run(GroupCollector(src, run_group, rollout_batch_size=1, over_sampling_batch_size=2,
                                     abort=abort).collect())
    assert [p.index for p in out.prompts] == [0]
    again = src.take(1)[0]
    assert again.index == 1 and again.partial is None


def test_groups_that_ignore_abort_are_cancelled_and_returned(tmp_path):
    src = source(write_prompts(tmp_path / "d.jsonl", ["mixed"] * 3))
    stuck = asyncio.Event()

    async def run_group(prompt):
        if prompt.index == 1:
            await stuck.wait()  # never set: an engine that does not honour abort
        return await make_runner(Engine())(prompt)

    out = asyncio.run(GroupCollector(src, run_group, rollout_batch_size=1, over_sampling_batch_size=2,
                                     partial_rollout=True, abort_timeout_s=0.05).collect())
    assert [p.index for p in out.prompts] == [0]
    assert [(p.index, p.partial) for p in src.take(2)] == [(1, None), (2, None)]


def test_a_failing_group_fails_the_rollout(tmp_path):
    src = source(write_prompts(tmp_path / "d.jsonl", ["mixed"] * 3))

    async def run_group(prompt):
        if prompt.index == 1:
            raise RuntimeError("engine died")
        await asyncio.sleep(0.01)
        return await make_runner(Engine())(prompt)

    with pytest.raises(RuntimeError, match="engine died"):
        asyncio.run(GroupCollector(src, run_group, rollout_batch_size=3).collect())


def test_generation_bookkeeping():
    g = Generation()
    g.append_model(GenerateOutput(output_ids=[5, 6], output_logprobs=[-0.1, -0.2], finish_reason="stop",
                                  weight_version=3))
    g.append_env([7, 8, 9])
    g.append_model(GenerateOutput(output_ids=[10], output_logprobs=[-0.3], finish_reason="length",
                                  weight_version=4))
    assert g.loss_mask == [1, 1, 0, 0, 0, 1] and g.response_logprobs == [-0.1, -0.2, 0.0, 0.0, 0.0, -0.3]
    assert g.weight_version == 3 and g.status == SampleStatus.TRUNCATED
    back = Generation.from_partial(g.to_partial(), mask_offpolicy=True)
    assert back.response_ids == g.response_ids and back.loss_mask == [0] * 6 and back.weight_version == 3
    s = g.to_sample([1, 2], group_index=7, index=1, label=5)
    s.validate("test")
    assert s.label == "5" and list(s.loss_mask) == g.loss_mask


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_restarts_between_rollouts_skip_and_repeat_nothing(tmp_path, seed):
    """Many rollouts with dynamic sampling, over-sampling, mid-flight aborts and partial
    rollout; the driver "restarts" after every commit from the JSON cursor. Over the
    run every prompt of every epoch is used (kept or dropped) exactly once."""
    import random

    rng = random.Random(seed)
    n, epochs = 23, 2
    labels = [rng.choice(["all1", "all0", "mixed", "mixed"]) for _ in range(n)]
    path = write_prompts(tmp_path / "d.jsonl", labels)
    used: list[tuple[int, int]] = []
    returned = resumed = 0
    state = None
    for _ in range(100):
        src = PromptSource(path, shuffle=True, seed=seed, num_epochs=epochs)
        orig = src._build
        src._build = lambda r, e, orig=orig: (lambda p: p and setattr(p, "prompt_ids", [100 + r]) or p)(orig(r, e))
        if state is not None:
            src.load_state_dict(state)
        stall = {p: rng.random() < 0.3 for p in range(n)}
        # slow groups finish on their own after 20 ms unless the collector aborts them first
        engine, slow = Engine(), Engine(stall_after=rng.randint(0, 3), stall_s=0.02)

        async def run_group(prompt, stall=stall, engine=engine, slow=slow):
            eng = slow if stall[prompt.index] and prompt.partial is None else engine
            return await make_runner(eng)(prompt)

        async def abort(slow=slow):
            slow.abort()

        coll = GroupCollector(src, run_group, rollout_batch_size=3, over_sampling_batch_size=rng.randint(3, 6),
                              filters=[zero_std_filter], partial_rollout=rng.random() < 0.5, abort=abort)
        out = asyncio.run(coll.collect())
        used += [p.uid for p in out.prompts] + [p.uid for p in out.dropped_prompts]
        returned += int(out.metrics["rollout/filter/groups_returned"])
        resumed += sum(p.partial is not None for p in out.prompts + out.dropped_prompts)
        for p, g in zip(out.prompts, out.groups):
            assert all(s.response_length == MAX_NEW for s in g)  # continued partials end complete
        state = json.loads(json.dumps(src.state_dict()))
        if out.exhausted:
            break
    assert sorted(used) == sorted((e, i) for e in range(epochs) for i in range(n))
    assert returned > 0 and resumed > 0  # the hand-back paths were exercised


def test_sample_filter_zeroes_the_loss_mask_of_removed_samples_and_checks_its_answer():
    """--rollout-sample-filter-path: False = not trained on (an all-zero mask, kept in its group);
    an answer that is not one bool per sample is one line naming the flag."""
    from rlslurm.rollout.filters import apply_sample_filter

    samples = [Sample(prompt_tokens=np.array([1, 2], dtype=np.int32), response_tokens=np.array(r, dtype=np.int32),
                      loss_mask=None if i else np.array([1, 0, 1], dtype=np.uint8), index=i, group_index=0)
               for i, r in enumerate([[5, 6, 7], [8], [9, 10]])]
    assert apply_sample_filter(lambda ss: [s.index != 0 for s in ss], "f.py:f", samples) == 1
    assert [s.effective_loss_mask().tolist() for s in samples] == [[0, 0, 0], [1], [1, 1]]
    for bad, why in ((lambda ss: [True], "returned 1 values for 3 samples"),
                     (lambda ss: [1, 1, 1], "returned 3 values for 3 samples"),
                     (lambda ss: None, "returned NoneType")):
        with pytest.raises(ConfigError, match=why) as e:
            apply_sample_filter(bad, "f.py:f", samples)
        assert "--rollout-sample-filter-path f.py:f" in str(e.value) and "\n" not in str(e.value)
