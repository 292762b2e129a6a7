"""End a server whose owner died, so a kill -9 of the rollout process leaves no engine or router behind.

Engines and the router are started in their own process group (engines/engine.py) so that the
supervisor can kill a whole server at once; the price is that nothing ends them when the process
that started them (the owner: the rollout driver) is killed without a chance to clean up. They
then keep their ports, their /dev/shm files and, on a GPU, their memory, and under `rlslurm run`
the next attempt cannot start (a SLURM step is cleaned up by slurmstepd, a local run is not).

`prctl(PR_SET_PDEATHSIG)` does not fit: it fires when the *thread* that forked the child ends, and
the supervisor restarts engines from short-lived threads. So the launcher (`python -m
rlslurm.engines.engine`) forks a small watcher into the server's process group. It polls the
launcher's parent pid: once the launcher has been re-parented (its owner is gone; a pid does not
come back as one's parent, so pid reuse cannot fool it), it sends SIGTERM to the group, gives the
server `grace_s` to go, then SIGKILL to the group (itself included). The watcher ends by itself
as soon as the launcher ends.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from rlslurm.engines import procfs

GRACE_S = 10.0
POLL_S = 0.5


def start(*, grace_s: float = GRACE_S, poll_s: float = POLL_S) -> int | None:
    """Fork the watcher for the calling process (the server's launcher); returns its pid, or None
    when there is no owner to watch. Call before any thread is started (fork)."""
    owner, leader = os.getppid(), os.getpid()
    if owner <= 1 or os.getpgid(0) != leader:
        return None  # no owner, or not in a group of its own (killpg would reach the caller's)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            # the supervisor's TERM to the group is for the server; the watcher ends with it anyway
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)
            _watch(owner, leader, grace_s, poll_s)
        finally:
            os._exit(0)
    return pid


def _watch(owner: int, leader: int, grace_s: float, poll_s: float) -> None:
    while True:
        time.sleep(poll_s)
        if os.getppid() != leader:
            return  # the launcher ended: nothing left to guard
        if procfs.parent_of(leader) not in (owner, None):
            break
    pgid = os.getpgid(0)
    print(f"rlslurm: the process that started this server (pid {owner}) is gone; ending the server "
          f"(process group {pgid})", file=sys.stderr, flush=True)
    os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and procfs.group_alive(pgid, besides=os.getpid()):
        time.sleep(0.1)
    os.killpg(pgid, signal.SIGKILL)
