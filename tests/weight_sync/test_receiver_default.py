"""`--update-weight-receiver auto` (issue 34 item 1): rlslurm's receiver by default where a GPU run proved it
(qwen3 and qwen3-MoE engines, weight_plan.py RECEIVER_PROVEN), SGLang's loader elsewhere; settled at submit
into run.yaml, and what the rollout node starts its engines with follows it."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlslurm.engines.receiver import LOADER
from rlslurm.resolve import resolve
from rlslurm.rollout.node import receiver_args
from rlslurm.settings.weight_plan import weight_sync_plan
from tests.helpers.hf_shape import hf_shaped_dir
from tests.helpers.prompt_files import prompt_lines


def _resolved(tmp_path: Path, model: str, *extra: str):
    prompts = tmp_path / "train.jsonl"
    prompts.write_text(prompt_lines({"prompt": "1+1=", "label": "2"}))
    hf = hf_shaped_dir(tmp_path / f"hf-{model}", model)
    return resolve(["--model", model, "--nodes", "2", "--prompt-data", str(prompts), "--hf-checkpoint", str(hf),
                    *extra], strict_inputs=False).cfg


@pytest.mark.parametrize("model, extra, want", [
    ("qwen3-4B", [], "rlslurm"),                                   # dense qwen3 on GPUs: proven
    ("qwen3-30B-A3B", [], "rlslurm"),                              # qwen3-MoE on GPUs: proven (30B-A3B, TP 2)
    ("glm4-9B", [], "sglang"),                                     # not proven on a GPU yet
    ("qwen3-4B", ["--device", "cpu", "--engines-per-node", "1"], "sglang"),  # CPU engines: SGLang's
    ("qwen3-4B", ["--update-weight-receiver", "sglang"], "sglang"),  # the user's choice stands
    ("glm4-9B", ["--update-weight-receiver", "rlslurm"], "rlslurm"),
], ids=["qwen3-gpu", "qwen3-moe-gpu", "glm4-gpu", "qwen3-cpu", "asked-sglang", "asked-rlslurm"])
def test_auto_receiver_is_settled_at_submit_and_the_engines_follow(tmp_path: Path, model: str, extra: list[str],
                                                                   want: str) -> None:
    """Fails before: the default was SGLang's loader everywhere, `auto` did not exist."""
    cfg = _resolved(tmp_path, model, *extra)
    assert cfg.train.update_weight_receiver == want  # what run.yaml keeps: no `auto` left
    plan = weight_sync_plan(cfg)
    assert plan.receiver == want
    assert (receiver_args(plan) == ("--custom-weight-loader", LOADER)) == (want == "rlslurm")
