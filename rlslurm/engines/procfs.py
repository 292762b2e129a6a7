"""Reading processes from /proc (Linux only, like SLURM): what ending a whole process tree needs to know,
for a server (engines/engine.py), a role of `rlslurm run` (local.py) and the owner watch
(engines/owner_watch.py)."""

from __future__ import annotations

import os
import signal
import time
from typing import Iterable

# live pids, each with its start time: a pid names the same process only while that matches (the kernel
# gives a freed pid to the next process that asks)
Pinned = dict[int, "int | None"]


def all_pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name (which may hold spaces and parentheses):
    [state, ppid, pgrp, ...]."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def state(pid: int) -> str | None:
    """The process's state letter (R, S, T: stopped, Z: zombie, ...); None when there is no such process."""
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def pid_alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a killed child not yet reaped still has a pid)."""
    return state(pid) not in (None, "Z")


def start_time(pid: int) -> int | None:
    """When the process started (clock ticks since boot): with the pid, it names one process, not a pid
    the kernel may give to another once this one is gone."""
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def parent_of(pid: int) -> int | None:
    fields = _stat_fields(pid)
    try:
        return int(fields[1]) if fields else None
    except (IndexError, ValueError):
        return None


def pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def group_alive(group: int, *, besides: int | None = None) -> bool:
    """Whether a live process (other than `besides`) is left in process group `group`."""
    return any(p != besides and pgid(p) == group and pid_alive(p) for p in all_pids())


def descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid in all_pids():
        ppid = parent_of(pid)
        if ppid is not None:
            children.setdefault(ppid, []).append(pid)
    out: set[int] = set()
    stack = [root]
    while stack:
        for c in children.get(stack.pop(), []):
            if c not in out:
                out.add(c)
                stack.append(c)
    return out


def pin(pids: Iterable[int]) -> Pinned:
    return {p: start_time(p) for p in pids if pid_alive(p)}


def alive(pinned: Pinned) -> list[int]:
    return [p for p, t in pinned.items() if pid_alive(p) and start_time(p) == t]


def signal_each(pinned: Pinned, sig: int = signal.SIGKILL) -> None:
    """Send `sig` to each pinned process still alive: descendants that called setsid (torchrun's workers,
    SGLang's schedulers) are out of reach of a signal to their ancestor's group."""
    for pid in alive(pinned):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def wait_gone(pinned: Pinned, timeout: float) -> bool:
    """Wait until none of the pinned processes is left: those reaped by init hold their memory (the
    GPU's too) until then. Whether they went within `timeout`."""
    deadline = time.monotonic() + timeout
    while alive(pinned):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True
