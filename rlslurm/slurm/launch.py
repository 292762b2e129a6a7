"""Per-node launcher, run by `srun` in each het group (one task per node).

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

from rlslurm.runfile import load_run_config


def trainer_argv(run_dir: Path, master_addr: str, master_port: int) -> list[str]:
    cfg = load_run_config(run_dir)
    # One srun task per node, so the task's rank is the node rank (submitit parses the step's env).
    step = SlurmJobEnvironment()
    nnodes, node_rank = step.num_tasks, step.global_rank
    return [
        # torchrun with its rendezvous store bound to the master address (slurm/torchrun.py)
        sys.executable, "-m", "rlslurm.slurm.torchrun",
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        f"--nproc-per-node={cfg.trainer_procs_per_node}",
        f"--master-addr={master_addr}",
        f"--master-port={master_port}",
        "-m", "rlslurm.trainer.main", "--run-dir", str(run_dir),
    ]


def rollout_argv(run_dir: Path, master_addr: str, master_port: int) -> list[str]:
    return [sys.executable, "-m", "rlslurm.rollout.main", "--run-dir", str(run_dir),
            "--trainer-addr", master_addr]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m rlslurm.slurm.launch")
    p.add_argument("role", choices=["trainer", "rollout"])
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--master-addr", required=True)
    p.add_argument("--master-port", type=int, required=True)
    a = p.parse_args(argv)
    if a.role == "trainer":
        cmd = trainer_argv(a.run_dir, a.master_addr, a.master_port)
    else:
        cmd = rollout_argv(a.run_dir, a.master_addr, a.master_port)
    sys.stdout.flush()
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
