from __future__ import annotations

import pytest

from rlslurm.buffer import RunDir
from tests.helpers.small_fs import small_fs  # noqa: F401  (registers the fixture here)


@pytest.fixture
def run(tmp_path) -> RunDir:
    return RunDir.create(tmp_path / "run")
