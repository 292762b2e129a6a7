"""What trainer rank 0's poll costs the shared filesystem while it waits for a rollout (trainer/main.py
`_poll`, every POLL_S for as long as rollouts are slower than training): one listing of control/ for
every record read from it, one listing of the buffer, a look for a later attempt every
SUPERSEDED_POLL_S (docs/shared-fs-load.md). Counted on the calls that reach the filesystem: a listing
(os.listdir, os.scandir) or an open (open, os.open) of a path under the run directory."""

from __future__ import annotations

import builtins
import os
import time
from collections import Counter

from rlslurm.trainer.commands import Next
from rlslurm.trainer.main import POLL_S
from tests.trainer.poll_trainer import engines, trainer


def test_a_waiting_poll_lists_control_and_the_buffer_once(tmp_path, monkeypatch):
    t = trainer(tmp_path)
    engines(t.control, b_awaiting=False)  # engines.json is read at every poll (a restarted engine?)
    run = str(t.rd.path) + "/"
    listed, opened = Counter(), Counter()

    def counting(fn, into):
        def wrapper(path=".", *a, **kw):
            p = os.fspath(path) if isinstance(path, (str, os.PathLike)) else ""
            if p.startswith(run):
                into[p[len(run):].rstrip("/")] += 1
            return fn(path, *a, **kw)
        return wrapper

    monkeypatch.setattr(os, "listdir", counting(os.listdir, listed))
    monkeypatch.setattr(os, "scandir", counting(os.scandir, listed))
    monkeypatch.setattr(builtins, "open", counting(builtins.open, opened))
    real_os_open = os.open
    count_os_open = counting(real_os_open, opened)  # records are read through os.open (atomic.read_regular)
    monkeypatch.setattr(os, "open", lambda path, flags, *a, **kw: (
        count_os_open if not flags & (os.O_WRONLY | os.O_RDWR) else real_os_open)(path, flags, *a, **kw))
    t0 = time.monotonic()
    assert [t._poll(3) for _ in range(3)] == [Next.WAIT] * 3
    assert time.monotonic() - t0 >= 3 * POLL_S  # a WAIT comes after POLL_S: the ranks do not spin
    assert listed["control"] == 3 and listed["buffer/train"] == 3, listed  # one each a poll
    assert listed["logs"] <= 1 and listed["buffer"] <= 1, listed  # a later attempt? retired? not every poll
    assert {k: v for k, v in opened.items() if k.startswith("control/")} == {"control/engines.json": 3}, opened
    t.control.request_stop("test")
    assert t._poll(3) is Next.STOP
