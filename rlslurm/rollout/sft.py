"""SFT rollouts: conversations from the prompt data, tokenized with the chat template, trained on
their assistant turns. No engine is involved (--debug-train-only, slime's SFT setting).

One record = one conversation (`--input-key messages`: a list of {role, content}, tools from
--tool-key or metadata["tools"]). Its tokens are the chat template's rendering of the whole
conversation, tokenized as the driver tokenizes prompts (the text, add_special_tokens=False); its
loss mask is 1 exactly on the tokens of every assistant turn - the turn's content and what closes
the turn (an end-of-turn token) - and 0 on system, user and tool turns and on each assistant turn's
header (the template's generation prompt). An assistant message with `"step_loss_mask": 0` (slime's
key) is kept as context but not trained.

How the turns are found, for any template (`mask_conversation`): the template renders each prefix
of the conversation (messages[:i], and messages[:i] with the generation prompt before an assistant
turn); every rendering must be a prefix of the next and of the whole conversation's, which cuts the
text into one segment per turn and header. Each segment is tokenized alone and their concatenation
must equal the whole text's tokenization (no token across a turn boundary). A template that renders
history differently from the conversation's end (e.g. Qwen3's, which drops earlier turns' <think>
blocks) or a tokenizer that merges across a boundary fails one of these checks: a one-line error
naming the record (file:line) and the turn, instead of a silently wrong mask.

The Sample: prompt_tokens are the tokens before the first trained token, response_tokens the rest
(later user/tool turns included, with loss mask 0), reward 0, no engine log-probs. The trainer
trains it with --loss-type sft_loss (or a custom loss) as any rollout.

`generate_rollout` is rlslurm's --rollout-function-path function for it (slime's
`slime.rollout.sft_rollout.generate_rollout` is mapped to it): --rollout-batch-size conversations
per rollout, one sample each (--n-samples-per-prompt 1). The driver commits them with the data
cursor as any rollout, so a requeue resumes after the last committed rollout and the trainer trains
each once (rollout/driver.py, trainer/main.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlslurm.buffer.sample import Sample
from rlslurm.errors import ConfigError, DataError

log = logging.getLogger(__name__)

SFT_ROLLOUT_FN = "rlslurm.rollout.sft:generate_rollout"
SLIME_SFT_ROLLOUT_FN = "slime.rollout.sft_rollout.generate_rollout"
TRAINED_ROLE = "assistant"


@dataclass
class MaskedConversation:
    tokens: list[int]
    loss_mask: list[int]      # one per token: 1 on assistant-turn tokens
    segments: list[tuple[str, int, int]]  # (what, first token, end token): turns and headers, in order

    def sample(self, where: str) -> Sample:
        """prompt = the tokens before the first trained one, response = the rest."""
        try:
            first = self.loss_mask.index(1)
        except ValueError:
            raise DataError(where, "no assistant token to train on (no assistant turn, or every one has "
                                   "step_loss_mask 0)") from None
        if first == 0:
            raise DataError(where, "the first token is trained: the chat template puts nothing before the first "
                                   "assistant turn, so it has no context to be scored in")
        toks = np.asarray(self.tokens)
        return Sample(prompt_tokens=toks[:first], response_tokens=toks[first:],
                      loss_mask=np.asarray(self.loss_mask[first:]), reward=0.0)


def check_chat_template(tokenizer: Any, what: str = "--hf-checkpoint") -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"{what}: the tokenizer has no chat template; SFT conversations are tokenized with it "
                          "(add chat_template to tokenizer_config.json)")


def _render(tokenizer: Any, messages: Sequence[Mapping[str, Any]], *, tools: Any, gen: bool,
            kwargs: Mapping[str, Any], where: str) -> str:
    try:
        text = tokenizer.apply_chat_template(list(messages), tools=tools, tokenize=False,
                                             add_generation_prompt=gen, **kwargs)
    except Exception as e:
        raise DataError(where, f"chat template failed on messages[:{len(messages)}]: {type(e).__name__}: {e}") from None
    if not isinstance(text, str):
        raise DataError(where, f"chat template returned {type(text).__name__}, not text")
    return text


def mask_conversation(tokenizer: Any, messages: Sequence[Mapping[str, Any]], *, tools: Any = None,
                      chat_template_kwargs: Mapping[str, Any] | None = None, where: str = "") -> MaskedConversation:
    """The conversation's tokens and its assistant-turn loss mask (module docstring); DataError naming
    `where` (file:line) when the template or the tokenizer makes the turns impossible to separate."""
    if not isinstance(messages, (list, tuple)) or not messages or \
            not all(isinstance(m, Mapping) and "role" in m and "content" in m for m in messages):
        raise DataError(where, "an SFT record must be a non-empty list of {role, content} messages (--input-key)")
    kw = dict(chat_template_kwargs or {})
    full = _render(tokenizer, messages, tools=tools, gen=False, kwargs=kw, where=where)
    # the text cut into segments: (start, what, trained), each running to the next one's start
    cuts: list[tuple[int, str, bool]] = []
    pos = 0

    def cut(text: str, what: str, trained: bool, rendered: str) -> None:
        nonlocal pos
        if len(text) < pos or not full.startswith(text):
            raise DataError(where, f"chat template: {rendered} does not render as a prefix of the whole "
                                   "conversation (the template renders a turn differently once later turns follow "
                                   "it, e.g. Qwen3's drops earlier <think> blocks), so the assistant tokens cannot be "
                                   "found; use a template that renders history as it rendered the turn")
        cuts.append((pos, what, trained))
        pos = len(text)

    last = len(messages) - 1
    for i, m in enumerate(messages):
        if str(m["role"]) != TRAINED_ROLE:
            continue
        if i == 0:
            raise DataError(where, "messages[0] is an assistant turn: there is nothing before it to condition it on")
        # everything before the turn's content: the earlier turns and this turn's header (generation prompt)
        head = _render(tokenizer, messages[:i], tools=tools, gen=True, kwargs=kw, where=where)
        cut(head, f"messages[:{i}] and the header of messages[{i}]", False,
            f"messages[:{i}] with the generation prompt")
        end = full if i == last else _render(tokenizer, messages[:i + 1], tools=tools, gen=False, kwargs=kw,
                                             where=where)
        cut(end, f"messages[{i}] (assistant)", m.get("step_loss_mask", 1) == 1, f"messages[:{i + 1}]")
    if pos < len(full):
        cuts.append((pos, "the turns after the last assistant turn", False))
    return _tokenize_segments(tokenizer, full, cuts, where)


def _tokenize_segments(tokenizer: Any, full: str, cuts: list[tuple[int, str, bool]], where: str
                       ) -> MaskedConversation:
    bounds = [c[0] for c in cuts] + [len(full)]
    tokens: list[int] = []
    mask: list[int] = []
    segments: list[tuple[str, int, int]] = []
    for (start, what, trained), end in zip(cuts, bounds[1:]):
        if end <= start:
            continue
        ids = list(tokenizer(full[start:end], add_special_tokens=False)["input_ids"])
        segments.append((what, len(tokens), len(tokens) + len(ids)))
        tokens += ids
        mask += [int(trained)] * len(ids)
    whole = list(tokenizer(full, add_special_tokens=False)["input_ids"])
    if whole != tokens:
        k = next((j for j, (a, b) in enumerate(zip(whole, tokens)) if a != b), min(len(whole), len(tokens)))
        seg = next((s[0] for s in segments if s[1] <= k < s[2]), "the end")
        raise DataError(where, f"the tokenizer merges text across a turn boundary (token {k}, in {seg}): the turns "
                               f"tokenized one by one ({len(tokens)} tokens) differ from the whole conversation "
                               f"({len(whole)} tokens), so the loss mask cannot be placed exactly")
    return MaskedConversation(tokens=tokens, loss_mask=mask, segments=segments)


def conversation_of(prompt: Any) -> tuple[list[Mapping[str, Any]], Any]:
    """The messages and tools of a served Prompt (rollout/data.py)."""
    messages = prompt.messages if prompt.messages is not None else prompt.prompt
    if isinstance(messages, str):
        raise DataError(prompt.where or f"record {prompt.index}",
                        "an SFT record must be a list of {role, content} messages (--input-key), not a string")
    tools = prompt.tools if prompt.tools is not None else (prompt.metadata or {}).get("tools")
    return list(messages), tools


def sft_sample(tokenizer: Any, prompt: Any, chat_template_kwargs: Mapping[str, Any] | None = None) -> Sample:
    messages, tools = conversation_of(prompt)
    where = prompt.where or f"record {prompt.index}"
    conv = mask_conversation(tokenizer, messages, tools=tools, chat_template_kwargs=chat_template_kwargs, where=where)
    return conv.sample(where)


async def generate_rollout(ctx: Any) -> Any:
    """--rollout-function-path for SFT (module docstring): --rollout-batch-size conversations, one
    Sample each. A record whose mask cannot be built, or longer than --rollout-max-context-len, is a
    DataError naming it; with --no-data-strict it is skipped (counted in rollout/sft/skipped) and
    another is taken in its place."""
    from rlslurm.rollout.rollout_fn import RolloutOutput

    r, d = ctx.cfg.rollout, ctx.cfg.data
    if r.n_samples_per_prompt != 1:
        raise ConfigError(f"SFT rollouts have one sample per conversation: --n-samples-per-prompt must be 1, "
                          f"got {r.n_samples_per_prompt}")
    check_chat_template(ctx.tokenizer)
    groups: list[list[Sample]] = []
    prompts: list[Any] = []
    skipped = 0
    trained_tokens = 0
    while len(groups) < r.rollout_batch_size:
        got = ctx.source.take(r.rollout_batch_size - len(groups))
        if not got:
            break
        for p in got:
            try:
                s = sft_sample(ctx.tokenizer, p, d.apply_chat_template_kwargs)
                limit = r.rollout_max_context_len
                if limit is not None and len(s.prompt_tokens) + s.response_length > limit:
                    raise DataError(p.where or f"record {p.index}", f"the conversation has "
                                    f"{len(s.prompt_tokens) + s.response_length} tokens, more than "
                                    f"--rollout-max-context-len {limit}")
            except DataError as e:
                if d.data_strict:
                    raise
                skipped += 1
                log.warning("SFT: skipping %s", e)
                continue
            s.weight_version = ctx.weight_version
            trained_tokens += int(s.effective_loss_mask().sum())
            groups.append([s])
            prompts.append(p)
            await asyncio.sleep(0)  # a stop may cancel between two conversations
    return RolloutOutput(groups=groups, prompts=prompts,
                         metrics={"rollout/sft/skipped": float(skipped),
                                  "rollout/sft/trained_tokens": float(trained_tokens)})
