"""--load-debug-rollout-data-subsample: whole groups of each replayed rollout, checked at submit."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlslurm.buffer.reader import RolloutReader
from rlslurm.buffer.rundir import RunDir
from rlslurm.buffer.writer import RolloutWriter
from rlslurm.resolve import resolve
from rlslurm.trainer.replay_subsample import kept_groups, subsample
from tests.buffer.helpers import make_meta, make_samples
from tests.helpers.config_errors import one_line_naming
from tests.helpers.prompt_files import prompt_lines


@pytest.mark.parametrize("n,f,kept", [(8, 0.5, [0, 1, 6, 7]), (8, 1.0, list(range(8))), (8, 0.4, [0, 1, 7]),
                                      (5, 0.2, [0]), (5, 0.1, []), (3, 0.67, [0, 2])])
def test_kept_groups_are_the_head_and_the_tail(n: int, f: float, kept: list[int]) -> None:
    assert kept_groups(n, f) == kept


@pytest.fixture
def replay_run(tmp_path: Path) -> Path:
    run = RunDir.create(tmp_path / "old").path
    w = RolloutWriter(run, kind="train")
    for rid in range(2):
        w.commit(rid, make_samples(rid, n=16), make_meta(rid))  # 4 groups of 4
    return run


def test_subsample_keeps_whole_groups(replay_run: Path) -> None:
    full = RolloutReader.replay(replay_run).read(1)
    half = subsample(full, 0.5)
    assert [s.group_index for s in half.samples] == [0] * 4 + [3] * 4
    assert [s.index for s in half.samples] == list(range(4)) + list(range(12, 16))
    assert half.rollout_id == 1 and len(full.samples) == 16


@pytest.fixture
def argv(prompts: Path, replay_run: Path) -> list[str]:
    return ["--model", "tiny-qwen3", "--prompt-data", str(prompts), "--load-debug-rollout-data", str(replay_run)]


def test_the_kept_groups_are_the_batch(argv: list[str]) -> None:
    cfg = resolve(argv + ["--load-debug-rollout-data-subsample", "0.5", "--rollout-batch-size", "2",
                          "--n-samples-per-prompt", "4", "--global-batch-size", "4",
                          "--micro-batch-size", "1"]).cfg
    assert cfg.train.load_debug_rollout_data_subsample == 0.5
    one_line_naming(argv + ["--load-debug-rollout-data-subsample", "0.5", "--rollout-batch-size", "4",
                            "--n-samples-per-prompt", "4", "--global-batch-size", "8"],
                    "--load-debug-rollout-data-subsample 0.5 keeps 2 of the 4 groups (8 samples)",
                    "--rollout-batch-size 4 x --n-samples-per-prompt 4 = 16",
                    "set --rollout-batch-size 2 --n-samples-per-prompt 4")
    one_line_naming(argv + ["--load-debug-rollout-data-subsample", "0.1"],
                    "--load-debug-rollout-data-subsample 0.1 keeps none of the 4 groups")


@pytest.mark.parametrize("value", ["0", "1.5", "-0.2"])
def test_a_fraction_out_of_range(argv: list[str], value: str) -> None:
    one_line_naming(argv + ["--load-debug-rollout-data-subsample", value], "--load-debug-rollout-data-subsample")


def test_it_needs_a_replay(tmp_path: Path) -> None:
    p = tmp_path / "p.jsonl"
    p.write_text(prompt_lines())
    one_line_naming(["--model", "tiny-qwen3", "--prompt-data", str(p), "--load-debug-rollout-data-subsample", "0.5"],
                    "--load-debug-rollout-data-subsample 0.5", "needs --load-debug-rollout-data RUN")
