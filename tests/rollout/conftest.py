"""The private CPU SGLang deployment of tests/rollout (the shared one, `deployment`, and `tiny_model`
are tests/conftest.py's): two fp32 servers (one pinned core each) behind the real sglang-router, under
the real EngineSupervisor, started by `tests/sglang_deploy.deploy` (~60 s on 2 cores each, so there
are two, not one per module):

- `private_deployment`: for the modules that restart engines or change their weight version
  (test_driver, test_partial_rollout). One deployment serves them all, reset for each module
  (no admission rule, version 0, both engines healthy and routed: what those tests start from;
  the weights are the HF ones throughout, as none of them loads others), and closed after the
  last module that uses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from tests.rollout.helpers import set_version
from tests.sglang_deploy import Deployment, deploy, new_api_key

__all__ = ["Deployment"]


_PRIVATE_USERS = "_rlslurm_private_deployment_users"


def pytest_collection_modifyitems(session, config, items) -> None:
    setattr(config, _PRIVATE_USERS, {i.module.__name__ for i in items if "private_deployment" in i.fixturenames})


@pytest.fixture(scope="session")
def _private_stack():
    with contextlib.ExitStack() as stack:
        yield stack, {}


def _reset(dep: Deployment, timeout: float = 300.0) -> None:
    """What each module starts from: no admission rule, version 0, both engines healthy and routed."""
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
def private_deployment(request, _private_stack, tmp_path_factory, tiny_model) -> Deployment:
    """For tests that restart engines or change their weight version, so that the shared
    `deployment`'s counters stay as test_engines.py expects (see the module docstring)."""
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
