"""Run under torchrun by tests/convert/conftest.py two_rank_runs: several of this directory's workers
(parity_worker.py, cli_worker.py), in turn, in one set of processes (a torchrun start costs ~20 s of
imports on the 2-core CI box). The process group the first one starts is kept for the next (their
init is skipped once it exists, their destroy until the last one), as cli_worker keeps it between
its commands; each worker runs as its own `__main__` with its own argv. A worker that fails raises,
so this process exits non-zero and torchrun stops the others.

    torchrun --nproc_per_node N tests/convert/chain_worker.py WORKER.py ARGS... -- WORKER.py ARGS...
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def main() -> None:
    import torch.distributed as dist

    chain, cur = [], []
    for a in sys.argv[1:]:
        if a == "--":
            chain.append(cur)
            cur = []
        else:
            cur.append(a)
    chain.append(cur)
    init, destroy = dist.init_process_group, dist.destroy_process_group

    def init_once(*args, **kwargs) -> None:
        if not dist.is_initialized():
            init(*args, **kwargs)

    dist.init_process_group = init_once
    try:
        for i, (script, *args) in enumerate(chain):
            dist.destroy_process_group = destroy if i == len(chain) - 1 else (lambda *a, **k: None)
            sys.argv = [script, *args]
            sys.path.insert(0, str(Path(script).resolve().parent))
            runpy.run_path(script, run_name="__main__")
    finally:
        dist.init_process_group, dist.destroy_process_group = init, destroy
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
