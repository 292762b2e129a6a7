"""The built-in rule rewards by --rm-type name (the names: rlslurm/settings/rm_types.py).

Besides rlslurm's `exact` and `math` (rollout/answers.py), the rules slime's recipes name
(`slime/rollout/rm_hub/`): `deepscaler`, `dapo`, `f1`, `gpqa`, `random` and the `boxed_<rule>`
variants that score only the last `\\boxed{}`. The rules mean what slime's do; the code is ours,
and where slime's has a quirk that scores right answers wrong it says so below. Like every
built-in rule these never raise on model output: garbage scores the rule's lowest value.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import re
import string
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from rlslurm.rollout.answers import Reward, RewardInput, exact_reward, last_boxed, math_reward

Rule = Callable[[RewardInput], Reward]

THINK_END = "</think>"


# --------------------------------------------------------------------------- deepscaler


def deepscaler_reward(item: RewardInput) -> float:
    """DeepScaleR's rule: only a response that finished thinking counts. The solution is the text
    after the last `</think>` (or after `###Response`); its last `\\boxed{}` must equal the label
    as mathematics (math-verify here, sympy/mathd normalisation in slime). 1 or 0."""
    text, label = item.response, item.label
    if not isinstance(text, str) or label is None:
        return 0.0
    if THINK_END in text:
        solution = text.rsplit(THINK_END, 1)[1]
    elif "###Response" in text:
        solution = text.split("###Response")[1]
    else:
        return 0.0  # still thinking when it stopped: no answer given
    answer = last_boxed(solution)
    gold = str(label)
    if "\\boxed" in gold or "\\fbox" in gold:
        gold = last_boxed(gold) or ""
    if answer is None or not answer.strip() or not gold.strip():
        return 0.0
    return math_reward(f"\\boxed{{{answer}}}", gold)


# --------------------------------------------------------------------------- dapo

_DAPO_TAIL_CHARS = 300  # DAPO scores only the tail: the longest MATH-500 answer has 159 characters
_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
# Minerva's answer normalisation (Lewkowycz et al. 2022, appendix D), as DAPO uses it:
_REPLACE = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
            (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_UNITS = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
          "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
          "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
          "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;",
          r",\!", "{,}", '"', "\\dots", "<|im_end|>", "<|endoftext|>")
_UNWRAP = tuple(re.compile(p) for p in (r"\\text\{(.*?)\}", r"\\textbf\{(.*?)\}", r"\\overline\{(.*?)\}",
                                        r"\\boxed\{(.*)\}"))


def minerva_normalize(answer: str) -> str:
    """A final answer in the canonical form Minerva/DAPO compare: right of the last '=', units,
    spaces, `$` and `\\text{}` wrappers gone, `\\frac12` -> `\\frac{1}{2}`, `1,000` -> `1000`."""
    s = str(answer).split("=")[-1]
    for old, new in _REPLACE:
        s = s.replace(old, new)
    for unit in _UNITS:
        s = s.replace(unit, "")
    inline = re.search(r"\$(.*?)\$", s)
    if inline:
        s = f"${inline.group(1)}$"  # the first inline-math span is the answer
    for wrapper in _UNWRAP:
        s = wrapper.sub(r"\1", s)
    s = re.sub(r"(frac)([^{])(.)", r"frac{\2}{\3}", s)
    s = re.sub(r"(sqrt)([^{])", r"sqrt{\2}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def _dapo_gold(label: Any) -> str:
    gold = minerva_normalize(label)
    try:
        value = float(gold)
    except ValueError:
        return gold
    # DAPO's answers are integers ("5.0" is 5). slime truncates every float (a label 2.5 would
    # accept "2"); a non-integral label is compared as text here instead.
    return str(int(value)) if value.is_integer() else gold


def dapo_reward(item: RewardInput) -> dict[str, float]:
    """DAPO's rule: the last `Answer: ...` line in the response's last 300 characters, normalised,
    equals the normalised label. {"score": 1 or -1, "acc": 1 or 0}; train on --reward-key score."""
    text, label = item.response, item.label
    correct = False
    if isinstance(text, str) and label is not None and str(label).strip():
        found = _ANSWER_LINE.findall(text[-_DAPO_TAIL_CHARS:])
        correct = bool(found) and minerva_normalize(found[-1]) == _dapo_gold(label)
    return {"score": 1.0 if correct else -1.0, "acc": 1.0 if correct else 0.0}


# --------------------------------------------------------------------------- f1

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)
_POLAR = ("yes", "no", "noanswer")


def squad_normalize(text: str) -> str:
    """SQuAD's answer normalisation: lower case, no punctuation, no articles, single spaces."""
    return " ".join(_ARTICLES.sub(" ", str(text).lower().translate(_PUNCT)).split())


def f1_reward(item: RewardInput) -> float:
    """Token F1 between the response and the label after SQuAD normalisation. A yes/no/noanswer
    on either side must match exactly (partial overlap with 'yes' is no answer)."""
    if not isinstance(item.response, str) or item.label is None:
        return 0.0
    pred, gold = squad_normalize(item.response), squad_normalize(item.label)
    if (pred in _POLAR or gold in _POLAR) and pred != gold:
        return 0.0
    pred_tokens, gold_tokens = pred.split(), gold.split()
    same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


# --------------------------------------------------------------------------- gpqa

_DEFAULT_LETTERS = tuple(string.ascii_uppercase[:10])
# "Answer: C", "the answer is (C)", "**Final answer:** C", "option C", "C is correct". The keyword
# is matched in any case, the letter only as a capital standing alone ("answer is a bit" is no C).
_CHOICE_PATTERNS = (
    re.compile(r"(?i:answer|option|choice)\W{0,3}(?:(?i:is)\W{0,3})?[(\[*]*([A-Z])(?![A-Za-z0-9])"),
    re.compile(r"(?<![A-Za-z0-9])\(?([A-Z])\)?\s+(?i:is\s+(?:the\s+)?correct)"),
)


def _letters(metadata: dict[str, Any], choices: list[Any] | None) -> tuple[str, ...]:
    if metadata.get("valid_letters"):
        return tuple(str(x).strip().upper() for x in metadata["valid_letters"])
    if choices:
        return tuple(string.ascii_uppercase[:len(choices)])
    return _DEFAULT_LETTERS


def _plain(text: Any) -> str:
    return re.sub(r"[^a-z0-9]+", " ", str(text).lower()).strip()


def chosen_letter(response: str, letters: Iterable[str]) -> str | None:
    """The option the response chose: the last 'answer is X'-style statement after the thinking,
    else the last capital letter standing alone that is an option."""
    valid = set(letters)
    text = response.rsplit(THINK_END, 1)[-1]
    stated = [m for p in _CHOICE_PATTERNS for m in p.finditer(text) if m.group(1) in valid]
    if stated:
        return max(stated, key=lambda m: m.start(1)).group(1)
    alone = [x for x in re.findall(r"\b([A-Z])\b", text) if x in valid]
    return alone[-1] if alone else None


def gpqa_reward(item: RewardInput) -> float:
    """Multiple choice: 1 when the chosen option is the correct one. The correct letter is the
    metadata's `correct_letter`, a one-letter label, an integer label (index into the options), or
    the option whose text equals the label; options come from metadata `choices` (list or dict)
    and `valid_letters` (default A-J). Without a letter on one side, 1 when the correct option's
    text appears in the answer."""
    response = item.response
    if not isinstance(response, str) or not response:
        return 0.0
    meta = item.metadata if isinstance(item.metadata, dict) else {}
    choices = meta.get("choices")
    choices = list(choices.values()) if isinstance(choices, dict) else (list(choices) if choices else None)
    letters = _letters(meta, choices)
    label = item.label
    correct = str(meta["correct_letter"]).strip().upper() if isinstance(meta.get("correct_letter"), str) else None
    label_text = label.strip() if isinstance(label, str) else None
    if correct is None and label_text and label_text.upper() in letters and len(label_text) == 1:
        correct = label_text.upper()
    elif correct is None and isinstance(label, int) and not isinstance(label, bool) and 0 <= label < len(letters):
        correct = letters[label]
    elif correct is None and label_text and choices:
        for letter, choice in zip(letters, choices):
            if _plain(choice) == _plain(label_text):
                correct = letter
                break
    chosen = chosen_letter(response, letters)
    if chosen and correct:
        return 1.0 if chosen == correct else 0.0
    texts = [meta.get("correct_answer"), meta.get("answer_text"), label_text]
    if correct and choices and correct in letters and letters.index(correct) < len(choices):
        texts.insert(0, choices[letters.index(correct)])
    # whole words, and no single characters: slime's substring test finds a label "E" in "the"
    answer = f" {_plain(response.rsplit(THINK_END, 1)[-1])} "
    return 1.0 if any(t and len(_plain(t)) > 1 and f" {_plain(t)} " in answer for t in texts) else 0.0


# --------------------------------------------------------------------------- random


def random_reward(item: RewardInput) -> float:
    """0 or 1 at random (a baseline to debug a pipeline with), seeded by the sample's prompt,
    response and label: a requeued rollout scores the same text the same way."""
    key = repr((item.prompt, item.response, item.label)).encode("utf-8", "surrogatepass")
    return float(random.Random(hashlib.sha256(key).digest()).randint(0, 1))


# --------------------------------------------------------------------------- table


def _boxed(rule: Rule) -> Rule:
    """A rule applied to the content of the last `\\boxed{}` only (slime's `boxed_<rule>`); no box: 0."""
    def scored(item: RewardInput) -> Reward:
        box = last_boxed(item.response) if isinstance(item.response, str) else None
        return 0.0 if box is None else rule(dataclasses.replace(item, response=box))
    return scored


def _exact(item: RewardInput) -> float:
    return exact_reward(item.response, item.label)


def _math(item: RewardInput) -> float:
    return math_reward(item.response, item.label)


def _boxed_math(item: RewardInput) -> float:
    # slime's boxed_math hands the box's content to its math rule, which then finds no \boxed in it
    # and scores 0 every time; the meaning is "math on the boxed answer only", which this is.
    box = last_boxed(item.response) if isinstance(item.response, str) else None
    return 0.0 if box is None else math_reward(f"\\boxed{{{box}}}", item.label)


RULES: dict[str, Rule] = {
    "exact": _exact,
    "math": _math,
    "deepscaler": deepscaler_reward,
    "dapo": dapo_reward,
    "f1": f1_reward,
    "gpqa": gpqa_reward,
    "random": random_reward,
    "boxed_math": _boxed_math,
    "boxed_exact": _boxed(_exact),
    "boxed_f1": _boxed(f1_reward),
    "boxed_gpqa": _boxed(gpqa_reward),
}
