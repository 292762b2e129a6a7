"""slime's --rm-type rules (rollout/rule_rewards.py) on model outputs as they look in practice, and
their registry (rlslurm/settings/rm_types.py)."""

from __future__ import annotations

import asyncio

import pytest

from rlslurm.errors import ConfigError
from rlslurm.rollout.rewards import RemoteRM, RewardError, RewardInput, build_reward_fn, score_group
from rlslurm.rollout.rule_rewards import (
    RULES,
    chosen_letter,
    dapo_reward,
    deepscaler_reward,
    f1_reward,
    gpqa_reward,
    minerva_normalize,
    random_reward,
)
from rlslurm.settings.rm_types import RM_REGISTRY, RM_TYPES


def item(response: str, label, metadata: dict | None = None) -> RewardInput:
    return RewardInput(prompt="Q", response=response, label=label, metadata=metadata or {}, where="d.jsonl:1")


QWEN3_RIGHT = ("<think>\nWe need the sum 1/4 + 1/4. Maybe \\boxed{1/3}? No: 1/4 + 1/4 = 2/4 = 1/2.\n</think>\n\n"
               "Adding the fractions gives $\\frac{2}{4}$, so the answer is $\\boxed{\\frac{1}{2}}$.<|im_end|>")


@pytest.mark.parametrize("response,label,expected", [
    (QWEN3_RIGHT, "0.5", 1.0),
    (QWEN3_RIGHT, "\\boxed{\\dfrac{1}{2}}", 1.0),       # a boxed label is unboxed first
    (QWEN3_RIGHT, "1/3", 0.0),                          # the box inside the thinking does not count
    ("<think>\n1/4 + 1/4 = \\boxed{1/2}", "1/2", 0.0),  # cut off while thinking: no answer
    ("<think>ok</think> The answer is one half.", "1/2", 0.0),   # no box after thinking
    ("### Instruction: add\n###Response: \\boxed{12}", "12", 1.0),
    ("<think>x</think>\\boxed{12}", "", 0.0),
    ("<think>x</think>\\boxed{12", "12", 0.0),          # unbalanced box: garbage, not an error
])
def test_deepscaler(response: str, label: str, expected: float) -> None:
    assert deepscaler_reward(item(response, label)) == expected


DAPO_RIGHT = ("Let me compute: the sum of the roots is 12 and their product is 5, so the requested value is "
              "12^2 - 2*5 = 134.\n\nAnswer: $134$")


@pytest.mark.parametrize("response,label,score", [
    (DAPO_RIGHT, "134", 1.0),
    (DAPO_RIGHT, "134.0", 1.0),                        # DAPO's integer labels may come as floats
    (DAPO_RIGHT, "135", -1.0),
    ("Answer: 1,024 ways", "1024", 1.0),               # thousands separator and unit word dropped
    ("so x = 7.\nAnswer: x = 7", "7", 1.0),            # right of the last '='
    ("Answer: 3\nwait, that is wrong.\nAnswer: 4", "4", 1.0),  # the last Answer line counts
    ("The answer is 134.", "134", -1.0),               # no 'Answer:' line
    ("Answer: 134" + " padding" * 60, "134", -1.0),    # outside the 300-character tail
    ("Answer: \\boxed{42}", "42", 1.0),
    ("", "42", -1.0),
])
def test_dapo(response: str, label: str, score: float) -> None:
    assert dapo_reward(item(response, label)) == {"score": score, "acc": 1.0 if score > 0 else 0.0}


def test_minerva_normalisation() -> None:
    assert minerva_normalize("\\frac12") == "\\frac{1}{2}"
    assert minerva_normalize("$\\text{5}$ dollars") == "5"
    assert minerva_normalize("90^\\circ") == "90"
    assert minerva_normalize("42<|im_end|>") == "42"


@pytest.mark.parametrize("response,label,expected", [
    ("The Eiffel Tower.", "Eiffel Tower", 1.0),
    ("It is the Eiffel Tower, in Paris.", "the eiffel tower", 2 * (2 / 6) * 1 / (2 / 6 + 1)),
    ("Paris", "Eiffel Tower", 0.0),
    ("yes it is", "yes", 0.0),                          # yes/no must match exactly
    ("Yes.", "yes", 1.0),
    ("no", "no answer", 0.0),
])
def test_f1(response: str, label: str, expected: float) -> None:
    assert f1_reward(item(response, label)) == pytest.approx(expected)


CHOICES = ["Helium", "Neon", "Argon", "Krypton"]


@pytest.mark.parametrize("response,label,meta,expected", [
    ("<think>Noble gases... maybe (A)? no.</think>\nThe answer is (C).", "C", {}, 1.0),
    ("<think>Answer: C</think>\n**Final answer:** B", "C", {}, 0.0),   # what follows the thinking counts
    ("Answer: B\nOn reflection, the answer is C", "C", {}, 1.0),       # the last statement wins
    ("C is correct because argon is a noble gas.", "C", {}, 1.0),
    ("The answer is a bit unclear, but I pick D", "D", {}, 1.0),       # 'a' is no option letter
    ("the answer is C", 2, {"choices": CHOICES}, 1.0),                 # an index label
    ("the answer is C", "Argon", {"choices": CHOICES}, 1.0),           # the option's text as label
    ("the answer is C", "x", {"choices": CHOICES, "correct_letter": "D"}, 0.0),
    ("I am fairly sure it is argon.", "Argon", {"choices": CHOICES}, 1.0),  # no letter: the option text
    ("the answer is E", "E", {"choices": CHOICES}, 0.0),               # E is no option of four
    ("", "C", {}, 0.0),
])
def test_gpqa(response: str, label, meta: dict, expected: float) -> None:
    assert gpqa_reward(item(response, label, meta)) == expected


def test_gpqa_letter_extraction() -> None:
    assert chosen_letter("Between A and B I choose B.", "ABCD") == "B"
    assert chosen_letter("No letter here", "ABCD") is None


def test_random_is_zero_or_one_seeded_by_the_sample() -> None:
    scores = [random_reward(item(f"response {i}", "x")) for i in range(200)]
    assert set(scores) == {0.0, 1.0} and 60 < sum(scores) < 140
    again = [random_reward(item(f"response {i}", "x")) for i in range(200)]
    assert again == scores  # a requeued rollout scores the same samples the same way


@pytest.mark.parametrize("rm_type,response,label,expected", [
    ("boxed_math", "so it is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("boxed_math", "so it is 0.5", "0.5", 0.0),                    # plain math would find 0.5; boxed needs a box
    ("boxed_f1", "Hmm, Paris? \\boxed{the Eiffel Tower}", "Eiffel Tower", 1.0),
    ("boxed_f1", "the Eiffel Tower", "Eiffel Tower", 0.0),
    ("boxed_gpqa", "A looks right, yet \\boxed{C}", "C", 1.0),
    ("boxed_exact", "\\boxed{ Paris }", "Paris", 1.0),
    ("math", "so it is 0.5", "0.5", 1.0),
])
def test_boxed_variants_score_only_the_box(rm_type: str, response: str, label: str, expected: float) -> None:
    fn = build_reward_fn(rm_type)
    assert asyncio.run(score_group([item(response, label)], fn)) == [expected]


def test_registry_and_rules_agree() -> None:
    assert set(RULES) == {t.name for t in RM_REGISTRY.values() if t.rule}
    assert set(RM_TYPES) - set(RULES) == {"remote", "remote_rm"}


def test_dapo_trains_on_reward_key_score_and_needs_one() -> None:
    fn = build_reward_fn("dapo")
    assert asyncio.run(score_group([item(DAPO_RIGHT, "134")], fn, reward_key="score")) == [
        {"score": 1.0, "acc": 1.0}]
    with pytest.raises(RewardError, match="set --reward-key"):
        asyncio.run(score_group([item(DAPO_RIGHT, "134")], fn))


def test_metadata_picks_a_slime_rule_per_record() -> None:
    fn = build_reward_fn("math")
    got = asyncio.run(score_group([item("The Eiffel Tower", "Eiffel Tower", {"rm_type": "f1"}),
                                   item("the answer is (B)", "B", {"rm_type": "gpqa"})], fn))
    assert got == [1.0, 1.0]


def test_remote_rm_is_slimes_name_for_remote() -> None:
    fn = build_reward_fn("remote_rm", rm_url="http://127.0.0.1:9/score")
    assert isinstance(fn.fn, RemoteRM) and fn.name == "--rm-url http://127.0.0.1:9/score"
    with pytest.raises(ConfigError, match="--rm-type remote_rm needs --rm-url"):
        build_reward_fn("remote_rm")
    with pytest.raises(ConfigError, match="--rm-type 'ifbench': not built in .*--custom-rm-path"):
        build_reward_fn("ifbench")
