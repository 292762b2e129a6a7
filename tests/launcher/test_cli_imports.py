"""The CLI's own process imports no torch: `rlslurm submit`, `status`, `stop`, `resubmit` and `run`
resolve and render on the login node, and torch's import alone took ~4 s of every such call on 2
cores (each `rlslurm` command of the SLURM tests, each `submit --dry-run` of every model). The roles
(trainer, engines, conversion) import it in their own processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_cli_and_what_its_commands_import_leave_torch_out() -> None:
    mods = ["rlslurm.cli", "rlslurm.resolve", "rlslurm.slurm.submit", "rlslurm.slurm.status", "rlslurm.slurm.render",
            "rlslurm.local", "rlslurm.models.model_from_hf"]
    code = ("import importlib, sys\n"
            f"for m in {mods!r}: importlib.import_module(m)\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120, check=True)
    assert p.stdout.strip() == "[]", p.stdout[:2000]


def test_the_convert_package_still_exports_its_api() -> None:
    import rlslurm.convert as convert
    from rlslurm.convert.export import mcore_to_hf
    from rlslurm.convert.hf_io import HFCheckpoint

    assert convert.mcore_to_hf is mcore_to_hf and convert.HFCheckpoint is HFCheckpoint
    assert all(callable(getattr(convert, n)) for n in convert.__all__)
