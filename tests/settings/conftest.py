"""Fixtures shared by the settings tests: the smallest command line `resolve()` accepts, with the
suite's prompt file (tests/conftest.py `prompts`)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def argv(prompts: Path) -> list[str]:
    return ["--model", "tiny-qwen3", "--prompt-data", str(prompts)]
