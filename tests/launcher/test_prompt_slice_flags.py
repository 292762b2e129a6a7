"""--prompt-data / --eval-prompt-data PATH@[START:END] (slime's slice) at submit: refused in one line naming the flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlslurm.errors import DataError
from rlslurm.resolve import resolve
from tests.config_errors import one_line_naming


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps({"prompt": f"say {i}", "label": str(i)}) + "\n" for i in range(10)))
    return p


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


def test_a_missing_sliced_file_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"none.jsonl: prompt file does not exist$"):
        resolve(["--model", "tiny-qwen3", "--prompt-data", f"{tmp_path}/none.jsonl@[0:5]"])
