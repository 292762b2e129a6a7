"""What every rule reward builds on: the sample a reward sees (`RewardInput`), the answer in its
last `\\boxed{}`, and the `exact` and `math` checks. rollout/rewards.py (the reward API and its
built-ins) and rollout/rule_rewards.py (slime's rules, which reuse these checks) both import it, so
neither imports the other's half back (they once did, through a function-level import).
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("rlslurm.rollout.rewards")  # the name its messages always had

Reward = float | dict[str, float]


@dataclass
class RewardInput:
    """What a reward function sees of one sample."""

    prompt: str | list[dict[str, Any]]
    response: str
    label: Any
    metadata: dict[str, Any] = field(default_factory=dict)
    response_ids: list[int] | None = None
    status: str = "completed"
    where: str = ""  # 'path:line' of the prompt, for messages


_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`, `\\boxed 5`), braces matched."""
    matches = list(_BOXED.finditer(text))
    for m in reversed(matches):
        i = m.end()
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1 : j]
            continue  # unbalanced: try an earlier one
        if m.group(0)[-1:].isspace():  # `\\boxed 5`
            token = re.match(r"[^\s$.,;]+", text[i:])
            if token:
                return token.group(0)
    return None


def _normalize_exact(value: Any) -> str:
    return " ".join(str(value).split())


def exact_reward(response: str, label: Any) -> float:
    """1.0 when the answer equals the label after whitespace normalisation.

    The answer is the last `\\boxed{}` if the response has one, else the whole response.
    """
    if not isinstance(response, str) or label is None:
        return 0.0
    boxed = last_boxed(response)
    answer = boxed if boxed is not None else response
    return 1.0 if _normalize_exact(answer) == _normalize_exact(label) else 0.0


# Long chains of thought without a box: only the tail can hold the final answer, and
# sympy time grows with the text math-verify has to scan.
_MATH_TAIL_CHARS = 2000


def _mv_timeout() -> int | None:
    # math-verify times out with signal.alarm, which only works on the main thread.
    return 5 if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=8192)
def _parse(text: str, timeout: int | None) -> tuple[Any, ...]:
    # LaTeX parsing costs milliseconds and dominates; the n samples of a group share a
    # label and often an answer, so most parses repeat. Parsed sympy objects are immutable.
    from math_verify import parse

    return tuple(parse(text, parsing_timeout=timeout))


def math_reward(response: str, label: Any) -> float:
    """1.0 when the response's final answer is mathematically equal to the label.

    The final answer is the last `\\boxed{}`; without one, math-verify looks for an
    answer in the tail of the response. Equality is math-verify's: fractions, decimals,
    LaTeX forms, units and percent signs, sets and intervals compare by value.
    """
    try:
        from math_verify import verify

        if not isinstance(response, str) or label is None or not response.strip():
            return 0.0
        timeout = _mv_timeout()
        gold_text = str(label).strip()
        if not gold_text:
            return 0.0
        boxed = last_boxed(response)
        if boxed is not None and _normalize_exact(boxed) == _normalize_exact(gold_text):
            return 1.0  # the same text is the same value: skip parsing
        # A bare label ("1/2", "\\frac{1}{2}") parses most reliably as LaTeX in a box.
        if "\\boxed" not in gold_text and "$" not in gold_text:
            gold_text = f"\\boxed{{{gold_text}}}"
        gold = _parse(gold_text, timeout) or _parse(str(label), timeout)
        if not gold:
            return 0.0
        pred_text = f"\\boxed{{{boxed}}}" if boxed is not None else response[-_MATH_TAIL_CHARS:]
        pred = _parse(pred_text, timeout)
        if not pred:
            return 0.0
        return 1.0 if verify(list(gold), list(pred), timeout_seconds=timeout) else 0.0
    except Exception as e:  # model garbage must never stop a rollout
        log.debug("math_reward: %s: %s", type(e).__name__, e)
        return 0.0
