"""Console output into a file or pipe is not wrapped: a message that names a long run path stays one
line that a user's grep (or a test) finds, whatever the width Rich would assume (80 off a terminal)."""

from __future__ import annotations

import os
import subprocess
import sys


def test_cli_message_into_a_pipe_is_one_line(tmp_path) -> None:
    long_dir = tmp_path / ("d" * 120) / "run"
    code = ("from pathlib import Path; from rlslurm.cli import err; import sys; "
            "err.print(f'{Path(sys.argv[1])}: cleared the earlier stop request')")
    env = {**os.environ, "COLUMNS": "40"}
    res = subprocess.run([sys.executable, "-c", code, str(long_dir)], capture_output=True, text=True, env=env,
                         check=True, timeout=60)
    assert res.stderr == f"{long_dir}: cleared the earlier stop request\n"
