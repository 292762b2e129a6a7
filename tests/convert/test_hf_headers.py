"""An HF checkpoint's tensor names come from the safetensors headers (JSON: an 8-byte little-endian length,
then the header), read without torch: submit checks --hf-checkpoint on login nodes that may have none
(issue 48 item 6; docs/supported-stacks.md)."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest

from rlslurm.convert.hf_io import HFCheckpoint
from rlslurm.errors import DataError
from rlslurm.safetensors_names import checkpoint_names, safetensors_header

ROOT = Path(__file__).resolve().parents[2]


def test_names_from_headers_are_safetensors_own(tiny_model: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(tiny_model / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    assert list(safetensors_header(tiny_model / "model.safetensors")) == sorted(keys) == keys
    assert checkpoint_names(tiny_model) == keys and HFCheckpoint(tiny_model).names() == keys
    header = safetensors_header(tiny_model / "model.safetensors")
    assert {"dtype", "shape", "data_offsets"} <= set(header[keys[0]])


@pytest.mark.parametrize("content", [b"", b"\x05\x00", struct.pack("<Q", 10**9) + b"{}", struct.pack("<Q", 3) + b"[1]",
                                     struct.pack("<Q", 4) + b"{no}"])
def test_a_file_that_is_not_safetensors_is_named(tmp_path: Path, content: bytes) -> None:
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(content)
    with pytest.raises(DataError, match=f"^{bad}: not a"):
        safetensors_header(bad)


def test_reading_a_checkpoints_names_imports_no_torch(tiny_model: Path) -> None:
    code = ("import sys\nfrom rlslurm.convert.hf_io import HFCheckpoint\nfrom rlslurm.preflight import check_hf_dir\n"
            f"print(len(HFCheckpoint({str(tiny_model)!r}).names()), 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    n, torch_loaded = out.stdout.split()
    assert int(n) > 0 and torch_loaded == "False"
