"""A multi-turn tool-calling generate function (--custom-generate-function-path).

The model may call a calculator by writing `call add ( 3 4 )`. Generation stops at the
closing `)` (a stop token), the tool runs, and its answer `result = 7` is appended to the
response with loss_mask 0: those tokens are in the context of later turns but the model
is never trained to produce them. Generation then continues until the model answers
without a call, runs out of turns, or runs out of `max_new_tokens` (which bounds the
whole response, tool tokens included).

It speaks the vocabulary of the tiny test models (rlslurm.tiny: words separated by
spaces, digits are single tokens); a real deployment swaps `parse_call`/`render_result`
for its model's tool-call format. Aborted samples resume from their tokens so far
(partial rollout): an unanswered call at the end of the tokens is answered first.
"""

from __future__ import annotations

from typing import Any

from rlslurm.buffer.sample import SampleStatus
from rlslurm.rollout.data import PartialSample, Prompt
from rlslurm.rollout.generate_api import GenerateContext, Generation, prompt_token_ids, remaining_budget

MAX_TURNS = 4
TOOLS = {
    "add": lambda args: sum(args),
    "count": lambda args: len(args),
}


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _words(tokenizer: Any, ids: list[int]) -> list[str]:
    return tokenizer.convert_ids_to_tokens(ids)


def parse_call(words: list[str]) -> tuple[str, list[int]] | None:
    """`call NAME ( d d ... )` at the end of `words` -> (NAME, digits); None if absent or malformed."""
    if not words or words[-1] != ")":
        return None
    try:
        start = len(words) - 1 - words[::-1].index("call")
    except ValueError:
        return None
    body = words[start + 1 : -1]
    if len(body) < 2 or body[1] != "(" or not all(w.isdigit() for w in body[2:]):
        return None
    return body[0], [int(w) for w in body[2:]]


def render_result(name: str, args: list[int]) -> str:
    tool = TOOLS.get(name)
    if tool is None:
        return "result = ?"
    return "result = " + " ".join(str(tool(args)))  # one token per digit


def _unanswered_call(tokenizer: Any, gen: Generation) -> tuple[str, list[int]] | None:
    # The last token is a model-written `)`: a call whose result is not appended yet,
    # either just generated or cut off by an abort right after it.
    if not gen.response_ids or gen.loss_mask[-1] != 1:
        return None
    return parse_call(_words(tokenizer, gen.response_ids[-16:]))


async def generate(ctx: GenerateContext, prompt: Prompt, sampling_params: dict[str, Any], *,
                   partial: PartialSample | None = None) -> Generation:
    tok = ctx.tokenizer
    gen = Generation.from_partial(partial) if partial is not None else Generation()
    if partial is not None and gen.finished and _unanswered_call(tok, gen) is None:
        return gen
    prompt_ids = prompt_token_ids(ctx, prompt)
    stop_ids = _ids(tok, ")")
    stop = set(sampling_params.get("stop_token_ids", [])) | set(stop_ids)
    params = {**sampling_params, "stop_token_ids": sorted(stop)}
    calls = int(gen.metadata.get("tool_calls", 0))
    for _ in range(MAX_TURNS + 1):
        call = _unanswered_call(tok, gen)
        if call is not None:
            result = _ids(tok, render_result(*call))
            if len(gen) + len(result) > int(sampling_params["max_new_tokens"]):
                gen.status = SampleStatus.TRUNCATED
                break
            gen.append_env(result)
            calls += 1
            if calls > MAX_TURNS:
                gen.status = SampleStatus.TRUNCATED  # the model keeps calling: stop the episode
                break
        budget = remaining_budget(gen, sampling_params)
        if budget <= 0:
            gen.status = SampleStatus.TRUNCATED
            break
        out = await ctx.generate(prompt_ids + gen.response_ids, {**params, "max_new_tokens": budget})
        gen.append_model(out)
        if gen.status != SampleStatus.COMPLETED or _unanswered_call(tok, gen) is None:
            break  # aborted, truncated, or an answer without a call: the episode is over
    gen.metadata["tool_calls"] = calls
    return gen
