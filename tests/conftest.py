"""Suite-wide fixtures: the SLURM cluster, and the tiny model and CPU SGLang deployment that
tests/engines and tests/rollout share (one deployment for both, ~60 s on 2 cores). Fixtures of one
area belong in conftest.py files of their own test subdirectories."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

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


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from rlslurm.settings.model_config import load_model_config
    from rlslurm.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(load_model_config("tiny-qwen3"), tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def deployment(tmp_path_factory, tiny_model):
    """Two real CPU SGLang servers behind the router (tests/sglang_deploy.py), for the whole session:
    tests/engines/test_engines.py checks their counters from the start, so no test restarts them or
    changes their weight version (tests/rollout's `private_deployment` is for that)."""
    from tests.sglang_deploy import deploy, new_api_key

    with deploy(tiny_model, tmp_path_factory.mktemp("rollout-logs"), api_key=new_api_key()) as dep:
        yield dep
