"""The demo's toy task, learnable by a random-init tiny model from reward alone in minutes on CPU.

Prompts are `say digits` or `say letters`; the reward is the fraction of response tokens of the
asked class (digits 0-9 or letters a-z of `rlslurm.tiny`'s vocabulary). A random model scores
about 10/64 on digits and 26/64 on letters (~0.28 mean); a model that has learnt to condition
on the prompt scores ~1. It exercises the whole loop: group sampling, GRPO advantages,
Megatron updates and weight sync into the SGLang engines.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from rlslurm.rollout.rewards import RewardInput
from rlslurm.tiny import WORDS

CLASSES = {
    "digits": {WORDS.index(c) for c in "0123456789"},
    "letters": {WORDS.index(c) for c in "abcdefghijklmnopqrstuvwxyz"},
}
_SPECIAL = {0, 1, 2, 3}


def make_prompts(path: str | Path, n: int = 64, seed: int = 0) -> Path:
    rng = random.Random(seed)
    path = Path(path)
    with path.open("w") as f:
        for _ in range(n):
            label = rng.choice(sorted(CLASSES))
            f.write(json.dumps({"prompt": f"say {label}", "label": label}) + "\n")
    return path


def reward(inp: RewardInput) -> float:
    """Fraction of generated (non-special) tokens in the class named by the label."""
    wanted = CLASSES.get(str(inp.label))
    if wanted is None:
        return 0.0
    if inp.response_ids is not None:
        ids = [t for t in inp.response_ids if t not in _SPECIAL]
    else:
        ids = [WORDS.index(w) for w in inp.response.split() if w in WORDS and WORDS.index(w) not in _SPECIAL]
    return sum(t in wanted for t in ids) / len(ids) if ids else 0.0
