"""Fixtures for tests/convert: tiny random-init HF checkpoints of every mapped family."""

from __future__ import annotations

from pathlib import Path

import pytest

from convert_helpers import FAMILIES


@pytest.fixture(scope="session")
def tiny_ckpts(tmp_path_factory) -> Path:
    """`<root>/<model>`: an HF checkpoint written by rlslurm.tiny for each family (fp32)."""
    from rlslurm.model_config import load_model_config
    from rlslurm.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny_hf")
    for name in FAMILIES:
        make_tiny_checkpoint(load_model_config(name), root / name)
    return root
