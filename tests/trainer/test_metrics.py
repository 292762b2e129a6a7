"""metrics.jsonl stays whole lines when the disk refuses a write (ENOSPC) or a crash tore a line:
the error names the file in one line, and no later line is swallowed by a torn one."""

from __future__ import annotations

import os

import pytest

from rlslurm.buffer.atomic import StorageError
from rlslurm.trainer.metrics import MetricsLogger, read_metrics


def _fill(fs) -> None:
    fd = os.open(fs / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"x" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)


def test_enospc_names_the_file_and_leaves_whole_lines(small_fs) -> None:
    path = small_fs / "metrics.jsonl"
    m = MetricsLogger(path, None, enabled=True)
    m.log(0, {"loss": 1.0})
    before = path.read_bytes()
    _fill(small_fs)
    # longer than what is left in the file's last page: part of it gets written before ENOSPC
    with pytest.raises(StorageError) as ei:
        m.log(1, {"loss": 2.0, "pad": "y" * 8000})
    msg = str(ei.value)
    assert msg.startswith(f"{path}: no space left on device while appending the metrics of step 1") and "\n" not in msg
    assert path.read_bytes() == before  # the refused line left nothing behind
    os.unlink(small_fs / "filler")
    m.log(2, {"loss": 3.0})
    assert [r["step"] for r in read_metrics(path)] == [0, 2]


def test_a_torn_last_line_does_not_swallow_the_next(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    m = MetricsLogger(path, None, enabled=True)
    m.log(0, {"loss": 1.0})
    with open(path, "ab") as f:
        f.write(b'{"step": 1, "attem')  # a crash in the middle of the write
    m.log(1, {"loss": 2.0})
    assert [r["step"] for r in read_metrics(path)] == [0, 1]
