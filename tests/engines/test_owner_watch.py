"""A server started through the launcher (`python -m rlslurm.engines.engine`) ends when the process
that started it is killed with SIGKILL (engines/owner_watch.py), and not while that process lives."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.process_groups import group_members

# stands in for SGLang: a server process with a child of its own, both in the launcher's group
SERVER = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("server up", flush=True)
time.sleep(600)
"""

# stands in for the rollout driver: starts the server in a session of its own, as the supervisor does
OWNER = """
import subprocess, sys
p = subprocess.Popen([sys.executable, "-m", "rlslurm.engines.engine", "slow_server"], start_new_session=True,
                     stdout=open("server.log", "ab"), stderr=subprocess.STDOUT)
print(p.pid, flush=True)
p.wait()
"""


def _env(tmp_path: Path) -> dict[str, str]:
    repo = str(Path(__file__).resolve().parents[2])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), repo])}


def test_a_server_outlives_no_owner_killed_with_sigkill(tmp_path: Path) -> None:
    (tmp_path / "slow_server.py").write_text(SERVER)
    owner = subprocess.Popen([sys.executable, "-c", OWNER], cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.PIPE,
                             text=True)
    server = int(owner.stdout.readline())
    try:
        deadline = time.monotonic() + 60
        while "server up" not in (tmp_path / "server.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(2.0)  # several polls of the watcher while the owner lives
        assert len(group_members(server)) >= 2, "the server and its child should still be running"
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        deadline = time.monotonic() + 20
        while group_members(server) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert group_members(server) == [], "the server's processes outlived their owner"
        assert "is gone; ending the server" in (tmp_path / "server.log").read_text()
    finally:
        for pid in group_members(server):
            os.kill(pid, signal.SIGKILL)


def test_the_watcher_ends_with_a_server_that_ends(tmp_path: Path) -> None:
    (tmp_path / "quick_server.py").write_text("print('served', flush=True)\n")
    p = subprocess.Popen([sys.executable, "-m", "rlslurm.engines.engine", "quick_server"], cwd=tmp_path,
                         env=_env(tmp_path), start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert p.communicate(timeout=60)[0].strip() == "served"
    deadline = time.monotonic() + 10
    while group_members(p.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert group_members(p.pid) == []
