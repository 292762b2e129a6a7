"""Teardown shared by the fixtures that start real SGLang servers + router (tests/rollout,
tests/weight_sync): stop them and prove no process of their groups is left running."""

from __future__ import annotations

import os

from rlslurm.engines.engine import pid_alive


def teardown_deployment(sup, router) -> None:
    pgids = [s.proc.pid for s in sup._slots if s.proc.proc is not None] + [router.proc.pid]
    sup.close()
    router.close()
    left = [p for p in (int(d) for d in os.listdir("/proc") if d.isdigit()) if _in_groups(p, pgids)]
    assert not left, f"processes left running after teardown: {left}"


def _in_groups(pid: int, pgids: list[int]) -> bool:
    try:
        return os.getpgid(pid) in pgids and pid_alive(pid)
    except OSError:
        return False
