"""What the trainer does on the shared run directory grows with its nodes, not its ranks (issue 31
item 8, docs/shared-fs-load.md): two gloo ranks under torchrun on one node train two rollouts, and
- only rank 0 (the node's local rank 0) ever writes control/heartbeats/: a heartbeat is a temp file
  and a rename, and per rank a 1,024-GPU job paid 1,024 of them every 10 s;
- only one process opens the buffer's files: rank 0 reads each rollout and broadcasts it, where every
  rank opened its manifest and data file.
The opens are counted with strace (`-f`: torchrun and its workers), which the test host has."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from conftest import REPO, commit_rollouts, free_port, make_run, metrics

pytestmark = [pytest.mark.megatron, pytest.mark.slow]


@pytest.mark.skipif(shutil.which("strace") is None, reason="counts the ranks' opens with strace")
def test_one_heartbeat_per_node_and_one_reader_of_the_buffer(tmp_path: Path, tiny_hf: Path) -> None:
    run = make_run(tmp_path / "run", tiny_hf, nproc=2, rollout=dict(num_rollout=2))
    commit_rollouts(run, range(2))
    trace = tmp_path / "opens.strace"
    cmd = ["strace", "-f", "-qq", "-e", "trace=open,openat", "-o", str(trace), sys.executable, "-m",
           "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port",
           str(free_port()), "-m", "rlslurm.trainer.main", "--run-dir", str(run)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert p.returncode == 0, p.stderr[-6000:]
    assert [m["rollout_id"] for m in metrics(run)][-1] == 1  # both rollouts trained, by both ranks
    beats = sorted(p.name for p in (run / "control" / "heartbeats").iterdir())
    # no trainer-1.json, not even a temp file of one: rank 1 never wrote a heartbeat
    assert beats == ["trainer-0.json"], beats
    buffer = re.escape(str(run / "buffer" / "train"))
    opened: dict[str, set[str]] = defaultdict(set)  # pid -> buffer files it opened
    for line in trace.read_text(errors="replace").splitlines():
        m = re.match(rf'(\d+) +open(?:at)?\((?:AT_FDCWD, )?"{buffer}/(\d+\.[^"]*(?:data|manifest\.json))"', line)
        if m:
            opened[m.group(1)].add(m.group(2))
    assert len(opened) == 1, dict(opened)  # one process read the rollouts: rank 0
