"""Suite-wide fixtures. Only the SLURM cluster lives here; area-specific fixtures belong in
conftest.py files of their own test subdirectories."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

try:
    from slurm_cluster import SlurmCluster
except ImportError:  # tests/ became a package: rootdir-relative import
    from tests.slurm_cluster import SlurmCluster


def _slurm_required() -> bool:
    """In CI (or when asked) SLURM tests must run: a cluster that cannot boot is an ERROR."""
    ci = os.environ.get("CI", "").strip().lower()
    return ci not in ("", "0", "false", "no") or os.environ.get("RLSLURM_REQUIRE_SLURM") == "1"


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """A real SLURM cluster on this host (tests/slurm_cluster/boot.sh), booted once per
    session and stopped (by pid) at the end. Jobs run as root on this machine."""
    if os.geteuid() != 0:
        reason = "the SLURM test cluster needs root (it starts munged/slurmctld/slurmd and writes /etc/slurm)"
        if _slurm_required():
            pytest.fail(f"{reason}; CI/RLSLURM_REQUIRE_SLURM=1 forbids skipping", pytrace=False)
        pytest.skip(f"{reason}; run as root or set CI=1 to make this an error")
    # 4 virtual nodes with 8 fake GPUs each: the production defaults (8 GPUs per node, 2+2 nodes)
    # must pass `sbatch --test-only` unchanged.
    os.environ.setdefault("RLSLURM_CI_NODES", "4")
    os.environ.setdefault("RLSLURM_CI_GPUS", "8")
    cluster = SlurmCluster(owner_pid=os.getpid())
    # A boot failure raises here, which pytest reports as an ERROR of every SLURM test:
    # with root available the cluster is expected to come up, CI or not.
    cluster.boot()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(autouse=True)
def _no_job_outlives_its_test(request) -> Iterator[None]:
    """A SLURM test that fails midway leaves its job running, holding the cluster's nodes: every
    later SLURM test would then wait for nodes and fail too. Cancel what a test left behind."""
    yield
    if "slurm_cluster" not in request.fixturenames:
        return
    left = request.getfixturevalue("slurm_cluster").cancel_all()
    if left:
        print(f"\n{request.node.nodeid}: cancelled the jobs it left in the queue: {left}")
