"""When the driver evaluates: every --eval-interval rollouts, rollout 0 unless --skip-eval-before-train."""

from __future__ import annotations

from pathlib import Path

from rlslurm.resolve import resolve
from rlslurm.rollout.driver import eval_due
from rlslurm.settings.config import RolloutSection, RunConfig
from tests.helpers.prompt_files import prompt_lines


def due(n: int, **rollout) -> list[int]:
    cfg = RunConfig(rollout=RolloutSection(**rollout))
    return [i for i in range(n) if eval_due(i, cfg)]


def test_every_interval_from_rollout_0() -> None:
    assert due(7, eval_interval=3) == [0, 3, 6]
    assert due(7) == [] and due(7, skip_eval_before_train=True) == []


def test_skip_eval_before_train_drops_rollout_0_only() -> None:
    assert due(7, eval_interval=3, skip_eval_before_train=True) == [3, 6]
    assert due(4, eval_interval=1, skip_eval_before_train=True) == [1, 2, 3]


def test_the_slime_flag_is_a_field(tmp_path: Path) -> None:
    p = tmp_path / "p.jsonl"
    p.write_text(prompt_lines())
    cfg = resolve(["--model", "tiny-qwen3", "--prompt-data", str(p), "--skip-eval-before-train"]).cfg
    assert cfg.rollout.skip_eval_before_train
