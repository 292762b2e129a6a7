"""examples/tool_calling: the multi-turn generate function against the GenerateContext contract.

`Scripted` is a deterministic in-process GenerateContext: its "policy" is a rule over
the context (call the tool named in the prompt, then answer with the tool's result),
and it honours max_new_tokens, stop_token_ids and aborts the way the engine does.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from rlslurm.buffer.sample import SampleStatus
from rlslurm.rollout.data import Prompt, PromptSource
from rlslurm.rollout.filters import GroupCollector, zero_std_filter
from rlslurm.rollout.generate_api import GenerateOutput, generate_group, load_generate_fn, run_generate
from rlslurm.rollout.rewards import RewardInput, load_reward_fn, score_group

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tool_calling"
GENERATE = f"{EXAMPLE / 'generate.py'}:generate"
REWARD = f"{EXAMPLE / 'reward.py'}:answer_reward"


def tiny_tokenizer():
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from rlslurm.tiny import tokenizer_json

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(tokenizer_json())),
                                   bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")


TOK = tiny_tokenizer()


class Scripted:
    """Policy: prompt `NAME d d ... ?` -> `call NAME ( d d ... )`; after `result = X` ->
    `answer X <eos>`. With sampling_seed odd it skips the tool and answers `answer 5`.
    `abort_at=(call_no, n)`: that engine call is aborted after n tokens."""

    def __init__(self, abort_at: tuple[int, int] | None = None):
        self.tokenizer = TOK
        self.abort_at = abort_at
        self.calls: list[dict] = []

    def _continuation(self, words: list[str], seed: int) -> list[str]:
        # The rest of the current turn: what the policy wants minus what the context
        # already holds of it (a resumed partial turn continues, it does not restart).
        q = words.index("?")
        name, args, after = words[0], words[1:q], words[q + 1 :]
        if "result" in after:
            j = len(after) - after[::-1].index("result") + 1  # past "result ="
            digits = []
            while j < len(after) and (after[j].isdigit() or after[j] == "?"):
                digits.append(after[j])
                j += 1
            turn, full = after[j:], ["answer", *digits, "<eos>"]
        elif seed % 2:
            turn, full = after, ["answer", "5", "<eos>"]
        else:  # what follows ")" is cut by the stop token
            turn, full = after, ["call", name, "(", *args, ")", "answer", "9", "<eos>"]
        assert full[: len(turn)] == turn, (turn, full)
        return full[len(turn) :]

    async def generate(self, input_ids, sampling_params) -> GenerateOutput:
        self.calls.append(dict(sampling_params))
        call_no = len(self.calls)
        await asyncio.sleep(0)
        words = TOK.convert_ids_to_tokens(input_ids)
        want = TOK.convert_tokens_to_ids(self._continuation(words, sampling_params.get("sampling_seed", 0)))
        stop = set(sampling_params.get("stop_token_ids", [])) | {TOK.eos_token_id}
        out: list[int] = []
        reason = "length"
        for t in want:
            if len(out) >= sampling_params["max_new_tokens"]:
                break
            out.append(t)
            if self.abort_at and self.abort_at[0] == call_no and len(out) == self.abort_at[1]:
                reason = "abort"
                break
            if t in stop:
                reason = "stop"
                break
        return GenerateOutput(output_ids=out, output_logprobs=[-0.5] * len(out), finish_reason=reason,
                              weight_version=call_no)


def prompt_for(text: str, label: str = "7") -> Prompt:
    return Prompt(index=0, epoch=0, prompt=text, prompt_ids=TOK(text, add_special_tokens=False)["input_ids"],
                  label=label, where="inline:1")


def words(ids) -> list[str]:
    return TOK.convert_ids_to_tokens(list(ids))


def run(ctx, prompt, max_new=32, partial=None, seed=0):
    fn = load_generate_fn(GENERATE)
    return asyncio.run(run_generate(fn, ctx, prompt, {"max_new_tokens": max_new, "sampling_seed": seed}, partial))


def test_tool_output_is_in_the_response_but_masked_out():
    ctx = Scripted()
    gen = run(ctx, prompt_for("add 3 4 ?"))
    assert words(gen.response_ids) == ["call", "add", "(", "3", "4", ")", "result", "=", "7", "answer", "7", "<eos>"]
    assert gen.loss_mask == [1, 1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1]
    assert gen.response_logprobs == [-0.5] * 6 + [0.0] * 3 + [-0.5] * 3
    assert gen.status == SampleStatus.COMPLETED and gen.metadata["tool_calls"] == 1
    assert gen.weight_version == 1  # oldest weights that wrote a trained token
    # the second turn saw the tool result in its context, and the call ended on the stop token
    assert len(ctx.calls) == 2 and TOK.convert_tokens_to_ids(")") in ctx.calls[0]["stop_token_ids"]
    assert ctx.calls[1]["max_new_tokens"] == 32 - 9
    text = TOK.decode(gen.response_ids, skip_special_tokens=True)
    reward = load_reward_fn(REWARD)
    assert asyncio.run(score_group([RewardInput("add 3 4 ?", text, "7")], reward)) == [1.0]
    # copying the tool line is not an answer
    assert asyncio.run(score_group([RewardInput("q", "result = 7", "7")], reward)) == [0.0]


def test_multi_digit_results_and_unknown_tools():
    gen = run(Scripted(), prompt_for("add 9 8 ?"))
    assert words(gen.response_ids)[6:] == ["result", "=", "1", "7", "answer", "1", "7", "<eos>"]
    gen = run(Scripted(), prompt_for("mul 2 3 ?"))
    assert words(gen.response_ids)[6:9] == ["result", "=", "?"] and gen.loss_mask[6:9] == [0, 0, 0]


@pytest.mark.parametrize("max_new,expect_len", [(8, 6), (4, 4), (11, 11)])
def test_max_new_tokens_bounds_the_whole_response(max_new, expect_len):
    gen = run(Scripted(), prompt_for("add 3 4 ?"), max_new=max_new)
    assert gen.status == SampleStatus.TRUNCATED and len(gen.response_ids) == expect_len <= max_new
    # a tool result is appended whole or not at all
    assert gen.loss_mask[6:] in ([], [0, 0, 0], [0, 0, 0, 1, 1])


@pytest.mark.parametrize("abort_at", [(1, 3), (1, 6), (2, 1)])
def test_aborted_episode_resumes_from_its_tokens(abort_at):
    full = run(Scripted(), prompt_for("add 3 4 ?"))
    cut = run(Scripted(abort_at=abort_at), prompt_for("add 3 4 ?"))
    assert cut.status == SampleStatus.ABORTED and 0 < len(cut.response_ids) < len(full.response_ids)
    assert cut.response_ids == full.response_ids[: len(cut.response_ids)]
    resumed_ctx = Scripted()
    resumed = run(resumed_ctx, prompt_for("add 3 4 ?"), partial=cut.to_partial())
    assert resumed.response_ids == full.response_ids and resumed.loss_mask == full.loss_mask
    assert resumed.status == SampleStatus.COMPLETED
    if abort_at == (1, 6):  # cut right after the call: the tool is answered before the next engine call
        assert words(cut.response_ids)[-1] == ")" and len(resumed_ctx.calls) == 1


def test_example_through_source_collector_and_reward(tmp_path):
    src = PromptSource(EXAMPLE / "data.jsonl", tokenizer=TOK, shuffle=True, seed=3)
    fn = load_generate_fn(GENERATE)
    reward = load_reward_fn(REWARD)
    ctx = Scripted()

    async def run_group(prompt):
        group = await generate_group(ctx, prompt, n=4, sampling_params={"max_new_tokens": 24}, reward_fn=reward,
                                     generate_fn=fn, seed_per_sample=True)
        for s in group:
            s.validate(f"{prompt.where} sample {s.index}")
        return group

    out = asyncio.run(GroupCollector(src, run_group, rollout_batch_size=4, filters=[zero_std_filter]).collect())
    assert len(out.groups) == 4
    for prompt, group in zip(out.prompts, out.groups):
        # even seeds use the tool and are right; odd seeds guess 5 (right only when the label is 5)
        assert [s.scalar_reward for s in group] == [1.0, 0.0, 1.0, 0.0]
        tool_sample = group[0]
        assert tool_sample.metadata["tool_calls"] == 1 and 0 in tool_sample.loss_mask
        assert list(group[1].loss_mask) == [1] * group[1].response_length


def test_generate_group_leaves_aborted_groups_unscored_and_keeps_env_rewards():
    from rlslurm.errors import DataError
    from rlslurm.rollout.generate_api import Generation
    from rlslurm.rollout.rewards import RewardFn

    calls: list[str] = []

    def reward(item):
        calls.append(item.response)
        return 1.0

    prompt = prompt_for("add 3 4 ?")
    group = asyncio.run(generate_group(Scripted(abort_at=(1, 2)), prompt, n=2, reward_fn=RewardFn(reward),
                                       sampling_params={"max_new_tokens": 24}, generate_fn=load_generate_fn(GENERATE)))
    assert sorted(s.status.value for s in group) == ["aborted", "completed"] and calls == []

    async def self_scoring(ctx, prompt, sampling_params):
        return Generation(response_ids=[5], response_logprobs=[-0.1], loss_mask=[1], reward=0.25)

    group = asyncio.run(generate_group(Scripted(), prompt, n=3, sampling_params={"max_new_tokens": 4},
                                       reward_fn=RewardFn(reward), generate_fn=self_scoring))
    assert [s.reward for s in group] == [0.25] * 3 and calls == []
    prompt.partial = [None]  # type: ignore[list-item]
    with pytest.raises(DataError, match="inline:1: handed back with 1 partial samples but n_samples_per_prompt is 3"):
        asyncio.run(generate_group(Scripted(), prompt, n=3, sampling_params={"max_new_tokens": 4},
                                   reward_fn=RewardFn(reward)))


def test_a_generate_functions_own_numpy_reward_is_stored_as_a_number():
    import numpy as np

    from rlslurm.rollout.generate_api import Generation
    from rlslurm.rollout.rewards import RewardError, RewardFn

    def scored(value):
        async def gen(ctx, prompt, sampling_params):
            return Generation(response_ids=[5], response_logprobs=[-0.1], loss_mask=[1], reward=value)
        return gen

    def run(value, reward_key=None):
        return asyncio.run(generate_group(Scripted(), prompt_for("add 3 4 ?"), n=2,
                                          sampling_params={"max_new_tokens": 4},
                                          reward_fn=RewardFn(lambda item: 1.0), generate_fn=scored(value),
                                          reward_key=reward_key))

    for value, want in ((np.float32(0.25), 0.25), (np.bool_(True), 1.0), ({"acc": np.float64(1)}, {"acc": 1.0})):
        group = run(value, "acc" if isinstance(value, dict) else None)
        assert [s.reward for s in group] == [want, want] and all(type(s.reward) in (float, dict) for s in group)
        for i, s in enumerate(group):
            s.validate(f"sample {i}")  # what the buffer's commit checks: np.float32 was refused here
    with pytest.raises(RewardError, match=r"generate function reward \(sample .*#0\): returned nan"):
        run(np.float32("nan"))


# --------------------------------------------------------------------------- the real engine


class RouterContext:
    """The GenerateContext contract over the real sglang-router (what the driver will do)."""

    def __init__(self, url: str, api_key: str):
        self.url, self.api_key, self.tokenizer = url, api_key, TOK

    async def generate(self, input_ids, sampling_params) -> GenerateOutput:
        from rlslurm.engines.sglang_client import SGLangClient

        async with SGLangClient(self.url, self.api_key) as c:
            out = await c.generate(list(input_ids), sampling_params, timeout=120)
        meta = out["meta_info"]
        entries = meta["output_token_logprobs"]
        return GenerateOutput(output_ids=[t for _, t, _ in entries], output_logprobs=[lp for lp, _, _ in entries],
                              finish_reason=meta["finish_reason"]["type"], weight_version=0)


def _wait_for_router(ctx: RouterContext, timeout: float = 120.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            asyncio.run(ctx.generate([1, 5], {"max_new_tokens": 1}))
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


@pytest.mark.sglang
@pytest.mark.slow
def test_partial_continuation_and_tool_turn_on_the_real_engine(deployment):
    """Greedy fp32 on real SGLang: a response aborted after 5 tokens and continued from its
    partial equals the uninterrupted one; a resumed tool call appends masked tool tokens and
    the engine continues from the tool result."""
    from rlslurm.rollout.generate_api import Generation, default_generate

    ctx = RouterContext(deployment.router.url, deployment.api_key)
    _wait_for_router(ctx)
    prompt = prompt_for("add 3 4 ?")
    greedy = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}

    full = asyncio.run(run_generate(default_generate, ctx, prompt, greedy))
    assert len(full.response_ids) == 12 and full.status == SampleStatus.TRUNCATED
    head = asyncio.run(run_generate(default_generate, ctx, prompt, {**greedy, "max_new_tokens": 5}))
    head.status = SampleStatus.ABORTED  # as if an abort had cut it here
    resumed = asyncio.run(run_generate(default_generate, ctx, prompt, greedy, head.to_partial()))
    assert resumed.response_ids == full.response_ids
    assert max(abs(a - b) for a, b in zip(resumed.response_logprobs, full.response_logprobs)) < 1e-4

    # the model wrote a call and was aborted right after it: the example answers the tool first
    call = Generation()
    call.append_model(GenerateOutput(output_ids=TOK.convert_tokens_to_ids(["call", "add", "(", "3", "4", ")"]),
                                     output_logprobs=[-1.0] * 6, finish_reason="abort", weight_version=0))
    gen = asyncio.run(run_generate(load_generate_fn(GENERATE), ctx, prompt, {**greedy, "max_new_tokens": 16},
                                   call.to_partial()))
    assert words(gen.response_ids[:9]) == ["call", "add", "(", "3", "4", ")", "result", "=", "7"]
    assert gen.loss_mask[:9] == [1] * 6 + [0] * 3 and len(gen.response_ids) <= 16
    direct = asyncio.run(ctx.generate(prompt.prompt_ids + gen.response_ids[:9],
                                      {**greedy, "max_new_tokens": len(gen.response_ids) - 9,
                                       "stop_token_ids": [TOK.convert_tokens_to_ids(")")]}))
    assert gen.response_ids[9:] == direct["output_ids"]  # the engine continued from the tool result
