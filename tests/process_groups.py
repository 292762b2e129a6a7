"""Teardown shared by the fixtures that start real SGLang servers + router (tests/rollout,
tests/weight_sync): stop them and prove no process of their groups is left running."""

from __future__ import annotations

import os


def teardown_deployment(sup, router) -> None:
    pgids = [s.proc.pid for s in sup._slots if s.proc.proc is not None] + [router.proc.pid]
    sup.close()
    router.close()
    left = [p for p in (int(d) for d in os.listdir("/proc") if d.isdigit()) if _in_groups(p, pgids)]
    assert not left, f"processes left running after teardown: {left}"


def _in_groups(pid: int, pgids: list[int]) -> bool:
    try:
        if os.getpgid(pid) not in pgids:
            return False
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def pid_alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a killed child not yet reaped still has a pid)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
