"""--rollout-max-context-len and --rollout-skip-special-tokens in `generate_group`: the response budget
shrinks to what the prompt leaves, and the reward sees the response decoded as asked."""

from __future__ import annotations

import asyncio
import json

import pytest

from rlslurm.errors import DataError
from rlslurm.rollout.data import Prompt
from rlslurm.rollout.generate_api import GenerateOutput, generate_group, with_context_cap
from rlslurm.rollout.rewards import RewardFn


def _tokenizer():
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from rlslurm.tiny import tokenizer_json

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(tokenizer_json())),
                                   bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")


TOK = _tokenizer()


class Answers:
    """An engine stand-in that answers `answer 5 <eos>`, cut at max_new_tokens; records the params."""

    tokenizer = TOK

    def __init__(self) -> None:
        self.params: list[dict] = []

    async def generate(self, input_ids, sampling_params) -> GenerateOutput:
        self.params.append(dict(sampling_params))
        want = TOK("answer 5 <eos>", add_special_tokens=False)["input_ids"]
        out = want[: sampling_params["max_new_tokens"]]
        return GenerateOutput(output_ids=out, output_logprobs=[-0.1] * len(out),
                              finish_reason="stop" if len(out) == len(want) else "length", weight_version=0)


def _prompt(text: str) -> Prompt:
    return Prompt(index=0, epoch=0, prompt=text, prompt_ids=TOK(text, add_special_tokens=False)["input_ids"],
                  label="5", where="p.jsonl:3")


def _run(engine: Answers, prompt: Prompt, **kw) -> tuple[list, list[str]]:
    seen: list[str] = []

    def reward(item):
        seen.append(item.response)
        return 1.0

    group = asyncio.run(generate_group(engine, prompt, n=2, sampling_params={"max_new_tokens": 16},
                                       reward_fn=RewardFn(reward), **kw))
    return group, seen


def test_context_cap_shrinks_the_response_budget() -> None:
    prompt = _prompt("say 5 ?")  # 3 tokens
    engine = Answers()
    group, _ = _run(engine, prompt, max_context_len=5)
    assert [p["max_new_tokens"] for p in engine.params] == [2, 2]
    assert all(len(s.prompt_tokens) + len(s.response_tokens) <= 5 for s in group)
    assert {s.status.value for s in group} == {"truncated"}
    engine = Answers()
    _run(engine, prompt, max_context_len=100)  # the cap is above --rollout-max-response-len
    assert [p["max_new_tokens"] for p in engine.params] == [16, 16]
    engine = Answers()
    _run(engine, prompt)
    assert [p["max_new_tokens"] for p in engine.params] == [16, 16]


def test_a_prompt_that_fills_the_context_is_named() -> None:
    with pytest.raises(DataError, match=r"p.jsonl:3: the prompt is 3 tokens, .* --rollout-max-context-len 3"):
        _run(Answers(), _prompt("say 5 ?"), max_context_len=3)
    assert with_context_cap({"max_new_tokens": 8, "top_p": 1.0}, 10, None, "x") == {"max_new_tokens": 8, "top_p": 1.0}


def test_skip_special_tokens_decides_what_the_reward_sees() -> None:
    _, seen = _run(Answers(), _prompt("say 5 ?"))
    assert seen == ["answer 5", "answer 5"]  # rlslurm's default (and --rollout-skip-special-tokens)
    _, seen = _run(Answers(), _prompt("say 5 ?"), skip_special_tokens=False)
    assert seen == ["answer 5 <eos>", "answer 5 <eos>"]  # slime's default
