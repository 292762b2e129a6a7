"""A 1 MiB tmpfs for the ENOSPC tests (tests/buffer/test_enospc.py, tests/trainer/test_metrics.py).
The fixture is registered by those directories' conftest.py; skipped only outside CI."""

from __future__ import annotations

import os
import subprocess

import pytest


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mnt)], capture_output=True,
                         text=True)
    if res.returncode != 0:
        msg = f"cannot mount a tmpfs for the ENOSPC test: {res.stderr.strip()}"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
