"""`python -m rlslurm.owned_role GRACE_S CMD...`: run CMD (exec, same pid) so that it ends when the
process that started it dies without stopping it.

`rlslurm run` starts the trainer and the rollout in sessions of their own (a Ctrl-C then reaches
only `rlslurm run`, which stops them in order). The price: a kill -9 of `rlslurm run` (or an OOM
kill) would leave both running, holding the GPUs, the ports and the run directory's lock, and the
next `rlslurm run` of the same run could not start. In a SLURM step slurmstepd ends them; here the
engines' owner watch does (engines/owner_watch.py): forked into the role's process group before the
exec, it sends the group SIGTERM once the role's parent is gone (the trainer then checkpoints, as on
any TERM) and SIGKILL after GRACE_S.
"""

from __future__ import annotations

import os
import sys

from rlslurm.engines import owner_watch


def argv(cmd: list[str], *, grace_s: float) -> list[str]:
    return [sys.executable, "-m", "rlslurm.owned_role", f"{grace_s:g}", *cmd]


def main(args: list[str]) -> None:
    if len(args) < 2:
        raise SystemExit("usage: python -m rlslurm.owned_role GRACE_S CMD [ARGS...]")
    owner_watch.start(grace_s=float(args[0]))
    os.execvp(args[1], args[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
