"""One real CPU SGLang deployment shared by tests/rollout/test_engines.py: two fp32 servers
(one pinned core each) behind the real sglang-router, under the real EngineSupervisor.

Started once per session (~30-40 s on 2 cores) by `tests/sglang_deploy.deploy`, which the
weight-sync tests share.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from tests.sglang_deploy import Deployment, deploy

__all__ = ["Deployment"]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from rlslurm.model_config import load_model_config
    from rlslurm.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(load_model_config("tiny-qwen3"), tmp_path_factory.mktemp("tiny-qwen3"))


def _key() -> str:
    return "-" + secrets.token_urlsafe(24)  # a leading '-' must not break argv parsing


@pytest.fixture(scope="session")
def deployment(tmp_path_factory, tiny_model) -> Deployment:
    with deploy(tiny_model, tmp_path_factory.mktemp("rollout-logs"), api_key=_key()) as dep:
        yield dep


@pytest.fixture(scope="module")
def private_deployment(tmp_path_factory, tiny_model) -> Deployment:
    """Like `deployment`, but for one module: for tests that restart engines or change their
    weight version and must not disturb the shared one's counters (torn down at module end)."""
    # a higher static fraction: SGLang's CPU memory profile fails when other processes on the
    # box (a second server starting beside it) allocate while it measures
    with deploy(tiny_model, tmp_path_factory.mktemp("rollout-logs"), api_key=_key(),
                extra_args=("--weight-version", "0", "--mem-fraction-static", "0.3")) as dep:
        yield dep
