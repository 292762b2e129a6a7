"""Het-group 1 entry point, one process per rollout node:
`python -m rlslurm.rollout.main --run-dir RUN --trainer-addr ADDR`.

Start-up: read RUN/run.yaml and record this node's placement (node list, GPUs, trainer head).
Then run this node's SGLang servers; node 0 also runs the router and the rollout driver.
The process ends when the run is FINISHED or a stop is requested.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from rlslurm.buffer.control import Control
from rlslurm.buffer.rundir import RunDir
from rlslurm.errors import UserError
from rlslurm.runfile import load_run_config
from rlslurm.slurm.jobenv import job_env
from rlslurm.slurm.report import write_env_report

POLL_S = 1.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlslurm.rollout.main")
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--trainer-addr", required=True)
    a = p.parse_args(argv)
    cfg = load_run_config(a.run_dir)
    rd = RunDir(a.run_dir)
    env = job_env()
    write_env_report(rd.path, "rollout", env.procid, {
        "trainer_addr": a.trainer_addr,
        "run_name": cfg.run.run_name,
        "sglang_args": cfg.sglang_args,
        "prompt_data": str(cfg.data.prompt_data) if cfg.data.prompt_data else None,
        "user_env": {k: os.environ.get(k) for k in cfg.slurm.env},
    })
    control = Control(rd)
    while not rd.is_finished():
        if control.stop_requested() or control.preempt_requested():
            break
        time.sleep(POLL_S)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as e:
        print(f"rlslurm rollout: error: {e}", file=sys.stderr)
        sys.exit(2)
