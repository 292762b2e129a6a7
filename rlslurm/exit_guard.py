"""Threads a process leaves blocked in a C++ wait that nothing can interrupt, and an exit that steps
around them.

A weight-sync join given up because the job is ending (trainer/weights/group.py) stays blocked in
c10d until its timeout. If that wait ends while the interpreter finalizes, CPython (3.11, 3.12) ends
the thread with pthread_exit inside C++ frames and the process aborts (SIGABRT, exit 134) with whatever
status it meant to exit with lost: seen at the end of the test suite in CI (stop 40); in a job, a
requeue or a user error would read as a crash. `exit(status)` ends the process with os._exit,
after flushing, while such a thread is alive; otherwise it is sys.exit (docs/slurm-preemption.md,
"A role's last second: the exit status must survive the interpreter's teardown").
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from typing import NoReturn

log = logging.getLogger(__name__)

_LEFT: list[threading.Thread] = []


def leave_behind(thread: threading.Thread) -> None:
    """`thread` is given up while blocked; the process must not finalize around it."""
    _LEFT.append(thread)


def still_blocked() -> list[threading.Thread]:
    _LEFT[:] = [t for t in _LEFT if t.is_alive()]
    return list(_LEFT)


def exit_now_if_blocked(status: int) -> None:
    """End the process now with `status` when a thread left behind is still blocked; else return."""
    left = still_blocked()
    if not left:
        return
    log.info("exiting without interpreter teardown: %s still blocked", ", ".join(t.name for t in left))
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def exit(status: int) -> NoReturn:  # noqa: A001 - sys.exit's counterpart
    exit_now_if_blocked(status)
    sys.exit(status)
