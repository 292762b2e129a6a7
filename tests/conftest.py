"""Suite-wide fixtures: the SLURM cluster, the tiny model, and the one CPU SGLang deployment that
tests/engines and tests/rollout share: two fp32 servers (one pinned core each) behind the real
sglang-router, under the real EngineSupervisor, started by `tests/helpers/sglang_deploy.deploy` (~60 s on
2 cores, so one serves every module; the guide's one SGLang pair):

- `private_deployment`: for the modules that restart engines or change their weight version
  (tests/rollout's test_driver, test_partial_rollout, ...). Reset for each module (no admission
  rule, version 0, both engines healthy and routed: what those tests start from; the weights are the
  HF ones throughout, as none of them loads others), and closed after the last module that uses it.
- `deployment`: the same one, for the modules that check its counters from the start
  (tests/engines/test_engines.py: no engine restarted yet, the router's first restart). Those
  modules run first of the ones that share it (pytest_collection_modifyitems below).

Fixtures of one area belong in conftest.py files of their own test subdirectories."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
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


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    """The prompt file of a test that only needs one to resolve a run: enough prompts for the default
    --num-rollout and --rollout-batch-size (tests/helpers/prompt_files.py). A module whose tests need other
    prompts defines its own `prompts`."""
    from tests.helpers.prompt_files import prompt_lines

    p = tmp_path / "train.jsonl"
    p.write_text(prompt_lines())
    return p


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from rlslurm.settings.model_config import load_model_config
    from rlslurm.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(load_model_config("tiny-qwen3"), tmp_path_factory.mktemp("tiny-qwen3"))


_PRIVATE_USERS = "_rlslurm_private_deployment_users"


def pytest_collection_modifyitems(session, config, items) -> None:
    # `deployment` depends on `private_deployment`, so its users are in `fixturenames` too
    users = {i.module.__name__ for i in items if "private_deployment" in i.fixturenames}
    setattr(config, _PRIVATE_USERS, users)
    fresh = {i.module.__name__ for i in items if "deployment" in i.fixturenames}
    first = next((k for k, i in enumerate(items) if i.module.__name__ in users), None)
    if first is not None and fresh:  # the modules of `deployment` first, whole and in file order
        tail = items[first:]
        items[first:] = ([i for i in tail if i.module.__name__ in fresh]
                         + [i for i in tail if i.module.__name__ not in fresh])


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:
    # A weight-sync join given up by a test (a job ending mid-sync) may still be blocked in c10d;
    # waking while the interpreter finalizes aborts pytest after every test passed (CI, stop 40).
    # The roles' exit steps around it the same way (rlslurm/exit_guard.py).
    import sys

    guard = sys.modules.get("rlslurm.exit_guard")
    if guard is not None:
        guard.exit_now_if_blocked(int(getattr(config, "_rlslurm_exitstatus", 1)))


def pytest_sessionfinish(session, exitstatus) -> None:
    session.config._rlslurm_exitstatus = int(exitstatus)


@pytest.fixture(scope="session")
def _private_stack():
    with contextlib.ExitStack() as stack:
        yield stack, {}


def _reset(dep, timeout: float = 300.0) -> None:
    """What each module starts from: no admission rule, version 0, both engines healthy and routed."""
    from tests.rollout.helpers import set_version

    sup = dep.supervisor
    sup.admit = None
    deadline = time.monotonic() + timeout
    while True:
        infos = sup.engines()
        routed = {w["url"] for w in dep.router.workers() if w["is_healthy"]}
        if all(i.healthy and i.url in routed for i in infos):
            break
        assert time.monotonic() < deadline, f"engines not healthy and routed after {timeout:g} s: {infos}"
        time.sleep(0.5)
    asyncio.run(set_version(dep, 0))


@pytest.fixture(scope="module")
def private_deployment(request, _private_stack, tmp_path_factory, tiny_model):
    """For tests that restart engines or change their weight version (see the module docstring)."""
    from tests.helpers.sglang_deploy import deploy, new_api_key

    stack, held = _private_stack
    if "dep" not in held:
        # a higher static fraction: SGLang's CPU memory profile fails when other processes on the
        # box (a second server starting beside it) allocate while it measures
        held["dep"] = stack.enter_context(deploy(
            tiny_model, tmp_path_factory.mktemp("rollout-logs"), api_key=new_api_key(),
            extra_args=("--weight-version", "0", "--mem-fraction-static", "0.3")))
    _reset(held["dep"])
    yield held["dep"]
    users = getattr(request.config, _PRIVATE_USERS, set())
    users.discard(request.module.__name__)
    if not users:  # the last module that uses it: free its cores and memory now
        held.pop("dep")
        stack.close()


@pytest.fixture(scope="module")
def deployment(private_deployment):
    """The shared deployment, for modules that run before any other used it (see the module docstring)."""
    return private_deployment
