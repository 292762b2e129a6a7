"""tools/ckpt_convert (the layout's converter path, issue 33 item 9) is `rlslurm convert` from a checkout:
the same help (with --submit) and a conversion, run from another directory with no PYTHONPATH (the
round trips at every TP/PP/EP are test_convert_cli's, through the same CLI)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from convert_helpers import REPO

pytestmark = pytest.mark.megatron

ENTRY = REPO / "tools" / "ckpt_convert"


def test_the_entry_is_rlslurm_convert(tmp_path: Path) -> None:
    from rlslurm.convert.meta import read_meta
    from rlslurm.settings.model_config import load_model_config
    from rlslurm.tiny import make_tiny_checkpoint

    help_ = subprocess.run([sys.executable, str(ENTRY), "--help"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=120, env={"PATH": "/usr/bin:/bin", "COLUMNS": "200"})
    assert help_.returncode == 0, help_.stderr
    assert "Usage: rlslurm convert" in help_.stdout and "hf-to-mcore" in help_.stdout and "--submit" in help_.stdout
    src = tmp_path / "hf"
    make_tiny_checkpoint(load_model_config("tiny-qwen3"), src)
    # one process, no torchrun (the CLI's own single-rank path): the conversion runs through the entry
    conv = subprocess.run([sys.executable, str(ENTRY), "hf-to-mcore", "--model", "tiny-qwen3", "--hf", str(src),
                           "--out", str(tmp_path / "mc"), "--dtype", "fp32"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""})
    assert conv.returncode == 0, conv.stdout[-3000:] + conv.stderr[-3000:]
    assert read_meta(tmp_path / "mc")  # the converter's record of what it wrote (convert/meta.py)
    assert list((tmp_path / "mc").glob("*.distcp"))
