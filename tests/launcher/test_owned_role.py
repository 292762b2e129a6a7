"""`rlslurm run`'s roles end when `rlslurm run` is killed outright (rlslurm/owned_role.py): the
role (here a stand-in command, exec'd under the same pid) gets SIGTERM at once and SIGKILL after the
grace, when it ignores the TERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from rlslurm import owned_role
from tests.helpers.process_groups import pid_alive


def _owner_of(cmd: list[str], grace_s: float) -> tuple[subprocess.Popen, int]:
    """A stand-in for `rlslurm run`: starts `cmd` as local.py does, prints its pid, waits forever."""
    code = textwrap.dedent(f"""
        import subprocess, sys, time
        p = subprocess.Popen({owned_role.argv(cmd, grace_s=grace_s)!r}, start_new_session=True)
        print(p.pid, flush=True)
        time.sleep(600)
    """)
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    return owner, int(owner.stdout.readline())


def _gone_within(pid: int, seconds: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        if not pid_alive(pid):
            return time.monotonic() - t0
        time.sleep(0.05)
    return None


def test_a_role_ends_when_its_owner_is_killed() -> None:
    owner, role = _owner_of(["sleep", "600"], grace_s=30)
    try:
        time.sleep(1.0)
        assert pid_alive(role), "the role must run while its owner lives"
        with open(f"/proc/{role}/cmdline", "rb") as f:
            assert f.read().split(b"\0")[0] == b"sleep"  # exec'd: the pid local.py holds is the role's own
        owner.kill()
        owner.wait()
        took = _gone_within(role, 10)
        assert took is not None, "the role outlived its owner's kill -9"
    finally:
        if pid_alive(role):
            os.killpg(role, signal.SIGKILL)


def test_a_role_that_ignores_term_is_killed_after_the_grace() -> None:
    owner, role = _owner_of(["bash", "-c", "trap '' TERM; while :; do sleep 0.1; done"], grace_s=2)
    try:
        time.sleep(1.0)
        owner.kill()
        owner.wait()
        took = _gone_within(role, 15)
        assert took is not None and took >= 1.5, took  # TERM ignored: only the KILL after the grace ends it
    finally:
        if pid_alive(role):
            os.killpg(role, signal.SIGKILL)
