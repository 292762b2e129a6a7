"""`rlslurm run` ends each role with its whole process tree (rlslurm/local.py `_stop`). torchrun starts
every worker in a session of its own, out of reach of a signal to the role's process group: on one
H100, a trainer worker still writing its TERM checkpoint outlived the KILL of torchrun and held 33.7 GiB
of the GPU after `rlslurm run` had returned (bench/results/gpu-lease-2026-12-07.md)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from rlslurm.engines import procfs
from rlslurm.local import _stop

# A role as torchrun makes one: the leader (the group `rlslurm run` signals) and a worker in a new
# session. The worker checkpoints on TERM for `save_s` seconds, then writes `done` and exits, or, with
# save_s < 0, ignores TERM (hung in a save).
WORKER = """
import os, signal, sys, time
save_s, done = float(sys.argv[1]), sys.argv[2]
def term(*_):
    time.sleep(save_s)
    open(done, "w").close()
    os._exit(0)
signal.signal(signal.SIGTERM, term if save_s >= 0 else signal.SIG_IGN)
open(done + ".pid", "w").write(str(os.getpid()))
while True:
    time.sleep(1)
"""


# The leader, as torchrun's agent: passes a TERM on to its worker and waits for it (torchrun's own wait is
# bounded too, but `rlslurm run` may KILL it first: the worker then lives on unless `_stop` ends it).
LEADER = """
import signal, subprocess, sys
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]], start_new_session=True)
signal.signal(signal.SIGTERM, lambda *_: worker.terminate())
worker.wait()
"""


def _role(tmp: Path, save_s: float) -> tuple[subprocess.Popen, Path]:
    done = tmp / "done"
    proc = subprocess.Popen([sys.executable, "-c", LEADER, WORKER, str(save_s), str(done)], start_new_session=True)
    deadline = time.monotonic() + 30
    while not (done.parent / "done.pid").exists():
        assert time.monotonic() < deadline, "the worker did not start"
        time.sleep(0.05)
    return proc, done


def test_a_worker_in_its_own_session_is_waited_for_while_it_saves(tmp_path: Path) -> None:
    proc, done = _role(tmp_path, save_s=2.0)
    worker = int((tmp_path / "done.pid").read_text())
    _stop(proc, grace=30.0)
    assert done.exists(), "returned before the worker had finished its save"
    assert not procfs.pid_alive(worker)


def test_a_worker_that_ignores_term_is_killed_before_stop_returns(tmp_path: Path) -> None:
    proc, done = _role(tmp_path, save_s=-1)
    worker = int((tmp_path / "done.pid").read_text())
    t0 = time.monotonic()
    _stop(proc, grace=1.0)
    assert not procfs.pid_alive(worker), "the worker outlived the role's stop"
    assert time.monotonic() - t0 < 30


def test_a_pid_pinned_to_another_start_time_is_not_signalled() -> None:
    """procfs.signal_each (`_stop` and an engine's kill_tree) signals a pid only while its start time is
    the one pinned: the kernel gives a freed pid to the next process, which must survive."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        pinned = procfs.pin([p.pid])
        stale = {p.pid: pinned[p.pid] - 1}  # as if a process pinned earlier had gone and p got its pid
        procfs.signal_each(stale)
        time.sleep(0.3)
        assert p.poll() is None, "a process that only reuses a pinned pid was killed"
        procfs.signal_each(pinned)
        assert p.wait(timeout=10) == -9
        assert procfs.wait_gone(pinned, 5.0)
    finally:
        p.kill()
        p.wait()
