"""The one registry of `--rm-type` names: what each built-in reward is, and the slime names rlslurm refuses.

Imported on the submit host (rlslurm/settings/config.py, rlslurm/resolve.py) and by the rollout
(rlslurm/rollout/rule_rewards.py implements every rule named here; a test checks the two agree).
No heavy imports here. The names are slime's (`slime/rollout/rm_hub/__init__.py`) where the rule
means the same, so a pasted slime recipe keeps its `--rm-type`; what differs: docs/slime-flags.md.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RMType:
    name: str
    rule: bool                           # scored on the rollout node by a built-in rule (no service)
    doc: str
    needs_url: bool = False              # an HTTP reward model at --rm-url
    dict_keys: tuple[str, ...] = ()      # returns a dict of these scores: --reward-key picks the trained one


_ALL = (
    RMType("math", True, "1 when the final answer (last \\boxed{}, else the response's tail) equals the label "
                         "as mathematics (math-verify)"),
    RMType("exact", True, "1 when the answer (last \\boxed{}, else the whole response) equals the label as text"),
    RMType("deepscaler", True, "DeepScaleR: the solution after the last </think> (or after ###Response) must "
                               "have a \\boxed{} answer mathematically equal to the label; 1 or 0"),
    RMType("dapo", True, "DAPO: the last 'Answer: ...' line of the response's tail, normalised, equals the "
                         "label; score 1 or -1 (acc 1 or 0)", dict_keys=("score", "acc")),
    RMType("f1", True, "token F1 of the response against the label (SQuAD normalisation)"),
    RMType("gpqa", True, "multiple choice: the chosen option letter (after </think>) equals the correct one "
                         "(the label letter, index or choice text; metadata choices/correct_letter)"),
    RMType("random", True, "0 or 1 at random, seeded by the sample (a baseline for debugging)"),
    RMType("boxed_math", True, "math on the last \\boxed{} only (no box: 0)"),
    RMType("boxed_exact", True, "exact on the last \\boxed{} only (no box: 0)"),
    RMType("boxed_f1", True, "f1 on the content of the last \\boxed{} (no box: 0)"),
    RMType("boxed_gpqa", True, "gpqa on the content of the last \\boxed{}"),
    RMType("remote", False, "POST {prompt, response, label, metadata} to --rm-url", needs_url=True),
    RMType("remote_rm", False, "slime's name for remote", needs_url=True),
)
RM_REGISTRY: dict[str, RMType] = {t.name: t for t in _ALL}
RM_TYPES: tuple[str, ...] = tuple(RM_REGISTRY)

# slime --rm-type names rlslurm does not build in, and what to use instead.
RM_REFUSED: dict[str, str] = {
    "ifbench": "not built in (it needs IFEval's instruction checkers); score it with --custom-rm-path "
               "module:function",
}


def rm_type_error(name: str) -> str | None:
    """Why `name` is not an --rm-type (None when it is one)."""
    if name in RM_REGISTRY:
        return None
    if name in RM_REFUSED:
        return RM_REFUSED[name]
    return f"choose one of {', '.join(RM_TYPES)}, or set --custom-rm-path"
