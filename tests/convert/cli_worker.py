"""Run under torchrun by tests/convert/test_convert_cli.py: several `rlslurm.convert` commands, in
turn, in one set of processes (each torchrun start costs ~20 s of imports on the 2-core CI box).

Each command is the CLI's own: the typer app of `python -m rlslurm.convert`, given the argv a user
would type after `torchrun ... -m rlslurm.convert`. Between two commands only torch.distributed's
process group outlives the command (`runtime.shutdown` still tears megatron's parallel state down,
as after every command; the next command sets it up again at its own TP/PP/EP). A command that fails
raises, so this process exits non-zero and torchrun stops the others.

    torchrun --nproc_per_node N tests/convert/cli_worker.py PLAN.json
PLAN.json: a list of argv lists, run in order.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from rlslurm.convert import runtime
    from rlslurm.convert.cli import app

    def shutdown_keeping_the_group() -> None:
        ps.destroy_model_parallel()

    shutdown = runtime.shutdown
    runtime.shutdown = shutdown_keeping_the_group
    try:
        for argv in plan:
            rc = app(argv, prog_name="ckpt_convert", standalone_mode=False)
            if rc:  # typer.Exit(2) of a refused command comes back as its code here
                raise SystemExit(f"ckpt_convert {' '.join(argv)}: exit code {rc}")
            dist.barrier()
    finally:
        runtime.shutdown = shutdown
    shutdown()


if __name__ == "__main__":
    from rlslurm.exit_guard import skip_final_gc_at_exit

    skip_final_gc_at_exit()  # the product roles' exit: seconds of a core saved per torchrun worker
    main()
