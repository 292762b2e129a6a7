"""The real CPU SGLang deployment for tests/rollout: two fp32 servers (one pinned core each) behind the
real sglang-router, under the real EngineSupervisor, started by `tests/sglang_deploy.deploy` (~60 s on
2 cores, so one serves every module here; the guide's one SGLang pair):

- `private_deployment`: for the modules that restart engines or change their weight version
  (test_driver, test_partial_rollout, ...). Reset for each module (no admission rule, version 0,
  both engines healthy and routed: what those tests start from; the weights are the HF ones
  throughout, as none of them loads others), and closed after the last module that uses it.
- `deployment`: the same one, for the modules that check its counters from the start
  (test_engines.py: no engine restarted yet, the router's first restart). Those modules run first
  of the ones that share it (pytest_collection_modifyitems below).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from pathlib import Path

import pytest

from tests.rollout.helpers import set_version
from tests.sglang_deploy import Deployment, deploy

__all__ = ["Deployment"]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from rlslurm.model_config import load_model_config
    from rlslurm.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(load_model_config("tiny-qwen3"), tmp_path_factory.mktemp("tiny-qwen3"))


def _key() -> str:
    return "-" + secrets.token_urlsafe(24)  # a leading '-' must not break argv parsing


_PRIVATE_USERS = "_rlslurm_private_deployment_users"


def pytest_collection_modifyitems(session, config, items) -> None:
    # `deployment` depends on `private_deployment`, so its users are in `fixturenames` too
    users = {i.module.__name__ for i in items if "private_deployment" in i.fixturenames}
    setattr(config, _PRIVATE_USERS, users)
    fresh = {i.module.__name__ for i in items if "deployment" in i.fixturenames}
    first = next((k for k, i in enumerate(items) if i.module.__name__ in users), None)
    if first is not None and fresh:  # the modules of `deployment` first, whole and in file order
        tail = items[first:]
        items[first:] = [i for i in tail if i.module.__name__ in fresh] + [i for i in tail if i.module.__name__ not in fresh]


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
    """For tests that restart engines or change their weight version (see the module docstring)."""
    stack, held = _private_stack
    if "dep" not in held:
        # a higher static fraction: SGLang's CPU memory profile fails when other processes on the
        # box (a second server starting beside it) allocate while it measures
        held["dep"] = stack.enter_context(deploy(
            tiny_model, tmp_path_factory.mktemp("rollout-logs"), api_key=_key(),
            extra_args=("--weight-version", "0", "--mem-fraction-static", "0.3")))
    _reset(held["dep"])
    yield held["dep"]
    users = getattr(request.config, _PRIVATE_USERS, set())
    users.discard(request.module.__name__)
    if not users:  # the last module that uses it: free its cores and memory now
        held.pop("dep")
        stack.close()


@pytest.fixture(scope="module")
def deployment(private_deployment) -> Deployment:
    """The shared deployment, for modules that run before any other used it (see the module docstring)."""
    return private_deployment
