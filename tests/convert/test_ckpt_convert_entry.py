"""tools/ckpt_convert (the layout's converter path, issue 33 item 9) is `rlslurm convert` from a checkout:
the same help (with --submit), and a round trip under torchrun from another directory gives back the
HF tensors bit for bit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from convert_helpers import REPO, check, run_procs

pytestmark = [pytest.mark.megatron, pytest.mark.slow]  # ~2 min on a loaded 2-core box

ENTRY = REPO / "tools" / "ckpt_convert"


def test_the_entry_is_rlslurm_convert(tmp_path: Path) -> None:
    from rlslurm.convert import HFCheckpoint
    from rlslurm.model_config import load_model_config
    from rlslurm.tiny import make_tiny_checkpoint

    help_ = subprocess.run([sys.executable, str(ENTRY), "--help"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=120, env={"PATH": "/usr/bin:/bin", "COLUMNS": "200"})
    assert help_.returncode == 0, help_.stderr
    assert "Usage: rlslurm convert" in help_.stdout and "hf-to-mcore" in help_.stdout and "--submit" in help_.stdout
    src = make_tiny_checkpoint(load_model_config("tiny-qwen3"), tmp_path / "hf") or tmp_path / "hf"
    check(run_procs(1, [str(ENTRY), "hf-to-mcore", "--model", "tiny-qwen3", "--hf", str(src), "--out",
                        str(tmp_path / "mc"), "--dtype", "fp32"]))
    check(run_procs(1, [str(ENTRY), "mcore-to-hf", "--model", "tiny-qwen3", "--load", str(tmp_path / "mc"), "--out",
                        str(tmp_path / "back"), "--hf-config-from", str(src)]))
    a, b = HFCheckpoint(src), HFCheckpoint(tmp_path / "back")
    assert set(a.names()) == set(b.names()) and all(torch.equal(a.get(n), b.get(n)) for n in a.names())
