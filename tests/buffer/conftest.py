from __future__ import annotations

import pytest

from rlslurm.buffer import RunDir


@pytest.fixture
def run(tmp_path) -> RunDir:
    return RunDir.create(tmp_path / "run")
