"""Fixtures shared by the settings tests: a prompt file with enough prompts for the default run
(tests/prompt_files.py) and the smallest command line `resolve()` accepts with it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.prompt_files import prompt_lines


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    p = tmp_path / "train.jsonl"
    p.write_text(prompt_lines())
    return p


@pytest.fixture
def argv(prompts: Path) -> list[str]:
    return ["--model", "tiny-qwen3", "--prompt-data", str(prompts)]
