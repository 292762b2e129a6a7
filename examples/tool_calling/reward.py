"""Reward for the tool-calling example (--custom-rm-path examples/tool_calling/reward.py:answer_reward).

The episode is solved when the model's last `answer` is the label. Tool output is part
of the response text too, so only words after the final `answer` count: copying a
`result = 7` line is not an answer.
"""

from __future__ import annotations

from rlslurm.rollout.rewards import RewardInput


def final_answer(response: str) -> str | None:
    words = response.split()
    if "answer" not in words:
        return None
    tail = words[len(words) - words[::-1].index("answer"):]
    digits = []
    for w in tail:
        if not w.isdigit():
            break
        digits.append(w)
    return "".join(digits) or None


def answer_reward(item: RewardInput) -> float:
    return 1.0 if final_answer(item.response) == str(item.label) else 0.0
