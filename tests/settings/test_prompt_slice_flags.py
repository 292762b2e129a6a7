"""--prompt-data / --eval-prompt-data PATH@[START:END] (slime's slice) at submit: refused in one line naming the
flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlslurm.errors import ConfigError, DataError
from rlslurm.resolve import resolve
from tests.helpers.config_errors import one_line_naming
from tests.helpers.prompt_files import numbered_prompts


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    return numbered_prompts(tmp_path / "p.jsonl", 10)


def test_a_slice_resolves_and_is_kept_in_the_config(prompts: Path) -> None:
    cfg = resolve(["--model", "tiny-qwen3", "--prompt-data", f"{prompts}@[2:-2]",
                   "--eval-prompt-data", "aime", f"{prompts}@[-3:]"]).cfg
    assert str(cfg.data.prompt_data) == f"{prompts}@[2:-2]"
    assert cfg.data.eval_prompt_data == ["aime", f"{prompts}@[-3:]"]


def test_a_relative_sliced_path_is_made_absolute(prompts: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(prompts.parent)
    cfg = resolve(["--model", "tiny-qwen3", "--prompt-data", "p.jsonl@[0:5]"]).cfg
    assert str(cfg.data.prompt_data) == f"{prompts}@[0:5]"


@pytest.mark.parametrize("flag", ["--prompt-data", "--eval-prompt-data"])
@pytest.mark.parametrize("tail,why", [("@[1:2:3]", "a slice is PATH@[START:END]"), ("@[x:]", "a slice is"),
                                      ("@[20:]", "the slice selects no records (the file has 10")])
def test_a_bad_slice_is_one_line_naming_the_flag(prompts: Path, flag: str, tail: str, why: str) -> None:
    argv = ["--model", "tiny-qwen3", "--prompt-data", str(prompts)]
    argv += [flag, f"{prompts}{tail}"] if flag == "--prompt-data" else [flag, "e", f"{prompts}{tail}"]
    one_line_naming(argv, flag, why)


def test_prompts_that_run_out_before_num_rollout_are_refused(prompts: Path) -> None:
    """The slice's records count, not the file's: 6 prompts x 2 epochs cannot fill 2 rollouts of 8."""
    base = ["--model", "tiny-qwen3", "--prompt-data", f"{prompts}@[2:-2]", "--rollout-batch-size", "8",
            "--num-rollout", "2"]
    one_line_naming(base + ["--num-epoch", "2"], f"{prompts}@[2:-2] has 6 prompts x --num-epoch 2",
                    "--num-rollout 2 x --rollout-batch-size 8 needs at least 16",
                    "pass --num-epoch 3 or --num-rollout 1")
    assert resolve(base + ["--num-epoch", "3"]).cfg.data.num_epoch == 3
    # a replay generates nothing: its prompt file is not asked to last
    with pytest.raises(ConfigError, match="--load-debug-rollout-data"):
        resolve(base + ["--load-debug-rollout-data", str(prompts.parent / "no-buffer")])


def test_a_missing_sliced_file_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"none.jsonl: prompt file does not exist$"):
        resolve(["--model", "tiny-qwen3", "--prompt-data", f"{tmp_path}/none.jsonl@[0:5]"])
