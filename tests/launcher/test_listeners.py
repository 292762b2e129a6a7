"""The unauthenticated torch.distributed stores rlslurm hosts listen on the address their peers dial,
not on every interface (torch's own bind, `::`): the weight-sync store and torchrun's rendezvous.
Real torch (TCPStore, torchrun); addresses read from /proc/net/tcp."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from rlslurm.net import free_port
from rlslurm.trainer.weights.group import GroupSpec, SyncGroup
from tests.helpers.listening import listening_addresses

ROOT = Path(__file__).resolve().parents[2]


def test_weight_sync_store_listens_on_its_address_only() -> None:
    port = free_port()
    group = SyncGroup(GroupSpec("127.0.0.1", port, 2, "bound", "gloo", 5.0)).open()
    try:
        assert listening_addresses(port) == ["127.0.0.1"]
    finally:
        group.close()
    assert listening_addresses(port) == []  # torch closed the socket it was handed


def test_torchrun_rendezvous_listens_on_the_master_address_only() -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "rlslurm.slurm.torchrun", "--nnodes=1", "--node-rank=0", "--nproc-per-node=2",
           "--master-addr=127.0.0.1", f"--master-port={port}", str(ROOT / "tests" / "helpers" / "listening.py")]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = sorted(l for l in p.stdout.splitlines() if l.startswith("rank "))
    # both ranks ran (the rendezvous worked) and saw one listener, on 127.0.0.1
    assert lines == [f"rank {r} rendezvous {port} listens on ['127.0.0.1']" for r in (0, 1)], p.stdout + p.stderr
