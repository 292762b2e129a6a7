"""Het-group 0 entry point, run by torchrun on every trainer rank:
`torchrun ... -m rlslurm.trainer.main --run-dir RUN`.

Start-up: read RUN/run.yaml, record this rank's placement, join torch.distributed (NCCL on GPUs,
gloo on CPU) and check the world matches the config. Then train rollouts from the buffer until
`num_rollout` are trained, and mark the run FINISHED.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from rlslurm.buffer.control import Control
from rlslurm.buffer.reader import RolloutReader
from rlslurm.buffer.rundir import RunDir
from rlslurm.errors import UserError
from rlslurm.runfile import load_run_config
from rlslurm.slurm.report import write_env_report


def init_distributed(device: str) -> tuple[int, int]:
    backend = "nccl" if device == "cuda" and torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend)
    return dist.get_rank(), dist.get_world_size()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlslurm.trainer.main")
    p.add_argument("--run-dir", type=Path, required=True)
    a = p.parse_args(argv)
    cfg = load_run_config(a.run_dir)
    rd = RunDir(a.run_dir)
    rank, world = init_distributed(cfg.run.device)
    write_env_report(rd.path, "trainer", rank, {
        "world_size": world,
        "master_addr": os.environ.get("MASTER_ADDR"),
        "master_port": os.environ.get("MASTER_PORT"),
        "run_name": cfg.run.run_name,
        "sglang_args": cfg.sglang_args,
        "prompt_data": str(cfg.data.prompt_data) if cfg.data.prompt_data else None,
        "user_env": {k: os.environ.get(k) for k in cfg.slurm.env},
    })
    expected = (cfg.slurm.trainer_nodes or 1) * cfg.trainer_procs_per_node
    if world != expected:
        raise UserError(f"trainer world size {world} != --trainer-nodes x procs per node = {expected}")
    # Every rank proves the collective path works before any real work.
    t = torch.ones(1)
    dist.all_reduce(t)
    assert int(t.item()) == world

    control = Control(rd)
    reader = RolloutReader(rd)
    status = 0
    if rank == 0:
        status = _wait_for_rollouts(cfg.rollout.num_rollout, reader, control, rd)
    dist.barrier()
    dist.destroy_process_group()
    return status


def _wait_for_rollouts(num_rollout: int, reader: RolloutReader, control: Control, rd: RunDir) -> int:
    """Until the Megatron training step lands (issue 4) the trainer consumes nothing: a run with
    num_rollout=0 is complete at once; otherwise it waits for rollouts and honours preempt/stop."""
    if num_rollout == 0:
        rd.mark_finished({"trained_rollouts": 0, "at": time.time()})
        return 0
    while True:
        if control.preempt_requested():
            control.ack_preempt(checkpoint_iteration=-1)
            return 0
        if control.stop_requested():
            return 0
        time.sleep(1.0)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as e:
        print(f"rlslurm trainer: error: {e}", file=sys.stderr)
        sys.exit(2)
