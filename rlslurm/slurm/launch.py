"""Per-node launcher, run by `srun` in each het group (one task per node), as the batch script's
step command (rlslurm/attempt.py: `step_argv`). With --nodes 1 both steps share the node and each
takes its own GPUs of the job's (rlslurm/gpus.py `step_gpus`).

`trainer`: execs torchrun with the node rank and world shape taken from the SLURM step and the
rendezvous (head address + per-attempt port) chosen by the batch script.
`rollout`: execs the rollout group's entry point.
Both first check the node's stack for the role (rlslurm/stacks.py), before torch is imported.
Exec, not subprocess: signals from srun reach torchrun / the rollout process directly.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from submitit.slurm.slurm import SlurmJobEnvironment

from rlslurm.attempt import rollout_argv, trainer_argv
from rlslurm.gpus import step_gpus
from rlslurm.settings.runfile import load_run_config
from rlslurm.stacks import check_run_role


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rlslurm.slurm.launch")
    p.add_argument("role", choices=["trainer", "rollout"])
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--master-addr", required=True)
    p.add_argument("--master-port", type=int, required=True)
    return p.parse_args(argv)


def role_argv(argv: list[str] | None = None) -> list[str]:
    """The command this node of the step runs, from the step's arguments and its SLURM environment."""
    a = _parse(argv)
    if a.role == "rollout":
        return rollout_argv(a.run_dir, trainer_addr=a.master_addr)
    # One srun task per node, so the task's rank is the node rank (submitit parses the step's env).
    step = SlurmJobEnvironment()
    cfg = load_run_config(a.run_dir)
    return trainer_argv(a.run_dir, nnodes=step.num_tasks, node_rank=step.global_rank,
                        procs_per_node=cfg.trainer_procs_per_node, master_addr=a.master_addr,
                        master_port=a.master_port, shutdown_timeout_s=cfg.slurm.signal_grace_s)


def main(argv: list[str] | None = None) -> int:
    a = _parse(argv)
    cfg = load_run_config(a.run_dir)
    # before torchrun or SGLang is imported: a node without a supported stack (torch missing included)
    # fails here in one line, recorded as a user error (rlslurm/stacks.py)
    check_run_role(a.role, cfg)
    cmd = role_argv(argv)
    gpus = step_gpus(cfg, a.role)
    if gpus is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus
    sys.stdout.flush()
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    # A UserError (an unsupported stack) ends the job without requeue (rlslurm/user_error.py).
    from rlslurm.user_error import run_dir_arg, run_role

    run_role(sys.argv[1] if len(sys.argv) > 1 else "launch", main, run_dir_arg)
