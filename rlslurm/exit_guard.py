"""How a role's process ends: threads it leaves blocked in a C++ wait that nothing can interrupt, an
exit that steps around them, and the final garbage collection it skips.

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


def skip_final_gc_at_exit() -> None:
    """For a role's `__main__`, first thing: at exit, freeze every object instead of letting the
    interpreter's last garbage collections walk them. Those walk every object the process ever created
    (torch, megatron-core: millions) and cost seconds of a core after the work is done (measured on 2
    cores: 5-8 s from the trainer's FINISHED to its exit, every attempt). Only the collector is
    skipped: every atexit handler (logging's flush, multiprocessing's join of its children,
    weakref.finalize), the flush of stdout/stderr and module teardown's refcount-driven cleanup run as
    before; cyclic garbage left at exit goes with the process. Not for a process that goes on (a test
    calling run_role): only the roles' __main__ blocks call it. The measurements: the doc cited at the
    top of this module."""
    import atexit
    import gc

    atexit.register(gc.freeze)
