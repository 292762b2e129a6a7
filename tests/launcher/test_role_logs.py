"""What a user reads in an attempt's logs (issue 33): the roles' logs are not flooded by httpx's
per-request INFO lines, and `rlslurm logs` shows the trainer's and the rollout's logs before the
engines' and the router's."""

from __future__ import annotations

import ast
import logging
import os
import subprocess
import sys
from pathlib import Path

from rlslurm import role_log
from rlslurm.buffer.rundir import RunDir

ROOT = Path(__file__).resolve().parents[2]


def test_httpx_request_lines_stay_out_of_the_roles_logs(monkeypatch) -> None:
    monkeypatch.setattr(logging.getLogger("httpx"), "level", logging.NOTSET)
    role_log.configure("%(message)s")
    assert not logging.getLogger("httpx").isEnabledFor(logging.INFO)      # "HTTP Request: POST ... 200 OK"
    assert logging.getLogger("httpx").isEnabledFor(logging.WARNING)
    for main in ("trainer/main.py", "rollout/main.py"):  # both roles set up logging through it
        calls = [n for n in ast.walk(ast.parse((ROOT / "rlslurm" / main).read_text()))
                 if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
        assert any(c.func.attr == "configure" and getattr(c.func.value, "id", "") == "role_log" for c in calls), main
        assert not any(c.func.attr == "basicConfig" for c in calls), main


def test_logs_show_trainer_and_rollout_before_engines(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path / "run")
    d = rd.attempt_log_dir(0)
    d.mkdir(parents=True)
    names = ["engine-n2-0.log", "engine-n2-1.log", "router.log", "rollout-0.log", "rollout-1.log",
             "trainer-0.log", "trainer-1.log", "trainer-10.log", "trainer-2.log"]
    for name in names:
        (d / name).write_text(f"{name} last line\n")
    p = subprocess.run([sys.executable, "-m", "rlslurm", "logs", str(rd.path), "-n", "1"], capture_output=True,
                       text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr
    shown = [line.split("/")[-1].removesuffix(" <==") for line in p.stdout.splitlines() if line.startswith("==> ")]
    assert shown == ["trainer-0.log", "trainer-1.log", "trainer-2.log", "trainer-10.log", "rollout-0.log",
                     "rollout-1.log", "engine-n2-0.log", "engine-n2-1.log", "router.log"]
