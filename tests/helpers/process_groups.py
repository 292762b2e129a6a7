"""Finding the processes tests start and kill: the teardown of the fixtures that start real SGLang
servers + router (tests/engines, tests/rollout, tests/weight_sync), which proves no process of their
groups is left running; the members of a process group; a run's trainer and rollout processes."""

from __future__ import annotations

import os
from pathlib import Path

from rlslurm.engines.procfs import all_pids, pid_alive


def teardown_deployment(sup, router) -> None:
    pgids = [s.proc.pid for s in sup._slots if s.proc.proc is not None] + [router.proc.pid]
    sup.close()
    router.close()
    left = [p for p in all_pids() if _in_groups(p, pgids)]
    assert not left, f"processes left running after teardown: {left}"


def _in_groups(pid: int, pgids: list[int]) -> bool:
    try:
        return os.getpgid(pid) in pgids and pid_alive(pid)
    except OSError:
        return False


def group_members(pgid: int) -> list[int]:
    """The live processes of process group `pgid`."""
    return [p for p in all_pids() if _in_groups(p, [pgid])]


def rollout_pids(run_dir: Path) -> list[int]:
    """This run's rollout process (`python -m rlslurm.rollout.main --run-dir RUN`): under `rlslurm run`
    one, the leader of its own session, whose group holds the driver and the engine supervisor."""
    return [pid for pid, argv in argvs() if b"rlslurm.rollout.main" in argv and str(run_dir).encode() in argv]


def argvs():
    """(pid, argv) of every live process, argv items as bytes; not the owner watchers `rlslurm run`
    forks beside its roles (rlslurm/owned_role.py), which keep the wrapper's argv, the role's in it."""
    for pid in all_pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"rlslurm.owned_role" not in argv:
            yield pid, argv


def trainer_pids(run_dir: Path, *, agent: bool = True) -> list[int]:
    """This run's trainer processes: every process whose argv names the trainer module and the run
    dir. `agent=False`: only the ranks (torchrun's workers and their children), not the torchrun
    agent or the srun that starts it (both name rlslurm.slurm.torchrun)."""
    out = []
    for pid, argv in argvs():
        if b"rlslurm.trainer.main" in argv and str(run_dir).encode() in argv \
                and (agent or b"rlslurm.slurm.torchrun" not in argv):
            out.append(pid)
    return out
