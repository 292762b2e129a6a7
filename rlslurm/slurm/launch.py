"""Per-node launcher, run by `srun` in each het group (one task per node), as the batch script's
step command (rlslurm/attempt.py: `step_argv`).

`trainer`: execs torchrun with the node rank and world shape taken from the SLURM step and the
rendezvous (head address + per-attempt port) chosen by the batch script.
`rollout`: execs the rollout group's entry point.
Exec, not subprocess: signals from srun reach torchrun / the rollout process directly.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from submitit.slurm.slurm import SlurmJobEnvironment

from rlslurm.attempt import rollout_argv, trainer_argv
from rlslurm.runfile import load_run_config


def role_argv(argv: list[str] | None = None) -> list[str]:
    """The command this node of the step runs, from the step's arguments and its SLURM environment."""
    p = argparse.ArgumentParser(prog="python -m rlslurm.slurm.launch")
    p.add_argument("role", choices=["trainer", "rollout"])
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--master-addr", required=True)
    p.add_argument("--master-port", type=int, required=True)
    a = p.parse_args(argv)
    if a.role == "rollout":
        return rollout_argv(a.run_dir, trainer_addr=a.master_addr)
    # One srun task per node, so the task's rank is the node rank (submitit parses the step's env).
    step = SlurmJobEnvironment()
    return trainer_argv(a.run_dir, nnodes=step.num_tasks, node_rank=step.global_rank,
                        procs_per_node=load_run_config(a.run_dir).trainer_procs_per_node,
                        master_addr=a.master_addr, master_port=a.master_port)


def main(argv: list[str] | None = None) -> None:
    cmd = role_argv(argv)
    sys.stdout.flush()
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
