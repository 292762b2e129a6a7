"""One real CPU SGLang deployment shared by tests/rollout/test_engines.py: two fp32 servers
(one pinned core each) behind the real sglang-router, under the real EngineSupervisor.

Started once per session (~30-40 s on 2 cores); torn down by pid/process group, and the
teardown checks that nothing it started is left running.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.process_groups import teardown_deployment


@dataclass
class Deployment:
    model_path: Path
    api_key: str
    router: object            # RouterProcess
    supervisor: object        # EngineSupervisor
    changes: list = field(default_factory=list)   # on_change payloads
    restarts: list = field(default_factory=list)  # RestartEvents
    log_dir: Path | None = None


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from rlslurm.model_config import load_model_config
    from rlslurm.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(load_model_config("tiny-qwen3"), tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def deployment(tmp_path_factory, tiny_model) -> Deployment:
    with deploy(tmp_path_factory, tiny_model) as dep:
        yield dep


@pytest.fixture(scope="module")
def private_deployment(tmp_path_factory, tiny_model) -> Deployment:
    """Like `deployment`, but for one module: for tests that restart engines or change their
    weight version and must not disturb the shared one's counters (torn down at module end)."""
    # a higher static fraction: SGLang's CPU memory profile fails when other processes on the
    # box (a second server starting beside it) allocate while it measures
    with deploy(tmp_path_factory, tiny_model,
                extra_args=("--weight-version", "0", "--mem-fraction-static", "0.3")) as dep:
        yield dep


@contextlib.contextmanager
def deploy(tmp_path_factory, tiny_model, *, extra_args: tuple[str, ...] = ()):
    from rlslurm.rollout import sglang_cpu

    if sglang_cpu.installed_sglang_version() is None:
        pytest.skip("sglang is not installed (tools/install.sh installs it)")
    from rlslurm.net import engine_port_block, free_port
    from rlslurm.rollout.engine import EngineSpec
    from rlslurm.rollout.router import RouterProcess
    from rlslurm.rollout.supervisor import EngineSupervisor

    logs = tmp_path_factory.mktemp("rollout-logs")
    key = "-" + secrets.token_urlsafe(24)  # a leading '-' must not break argv parsing
    host = "127.0.0.1"
    ports = engine_port_block(host, 2)
    ncpu = os.cpu_count() or 1
    specs = [EngineSpec(name=f"engine-{i}", model_path=str(tiny_model), host=host, port=p.port,
                        nccl_port=p.nccl_port, log_path=logs / f"engine-{i}.log", api_key=key,
                        dtype="float32", device="cpu", cpu_core=i % ncpu, max_total_tokens=8192,
                        extra_args=("--random-seed", str(i), *extra_args))
             for i, p in enumerate(ports)]
    router = RouterProcess(host=host, port=free_port(host), log_path=logs / "router.log", api_key=key,
                           health_check_interval_s=2)
    dep = Deployment(model_path=tiny_model, api_key=key, router=router, supervisor=None, log_dir=logs)
    sup = EngineSupervisor(specs, router, health_interval_s=1.0, health_timeout_s=3.0, unhealthy_after=2,
                           start_timeout_s=300, restart_backoff_s=2.0,
                           on_change=dep.changes.append, on_restart=dep.restarts.append)
    dep.supervisor = sup
    # A proxy that answers nothing, as on clusters whose nodes set http_proxy for the outside
    # world: neither our clients nor the router may send cluster-internal calls through it.
    proxy_vars = ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY")
    saved = {k: os.environ.get(k) for k in proxy_vars}
    os.environ.update({k: f"http://127.0.0.1:{free_port()}" for k in proxy_vars})
    try:
        router.start()
        sup.start()
    except BaseException:
        router.close()
        raise
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        yield dep
    finally:
        teardown_deployment(sup, router)
