"""The real CPU SGLang deployment shared by tests/engines, tests/rollout and tests/weight_sync: two fp32 servers
(one pinned core each) behind the real sglang-router, under the real EngineSupervisor, with the
supervisor's production health settings scaled down for tests (1 s checks, 2 failures).

Torn down by pid/process group; the teardown checks that nothing it started is left running.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import pytest

from tests.helpers.process_groups import teardown_deployment


@dataclass
class Deployment:
    model_path: Path
    api_key: str
    router: object            # RouterProcess
    supervisor: object        # EngineSupervisor
    changes: list = field(default_factory=list)   # on_change payloads
    restarts: list = field(default_factory=list)  # RestartEvents
    log_dir: Path | None = None


def new_api_key() -> str:
    return "-" + secrets.token_urlsafe(24)  # a leading '-' must not break argv parsing


@contextlib.contextmanager
def deploy(model_path: Path, log_dir: Path, *, api_key: str, extra_args: tuple[str, ...] = (),
           on_change: Callable[[list], None] | None = None) -> Iterator[Deployment]:
    """`on_change` is called after the deployment's own record of each change (e.g. the weight
    sync tests publish control/engines.json from it, as the rollout node does)."""
    from rlslurm.engines import sglang_cpu

    if sglang_cpu.installed_sglang_version() is None:
        pytest.skip("sglang is not installed (tools/install.sh installs it)")
    from rlslurm.engines.engine import EngineSpec
    from rlslurm.engines.router import RouterProcess
    from rlslurm.engines.supervisor import EngineSupervisor
    from rlslurm.net import engine_port_block, free_port

    log_dir.mkdir(parents=True, exist_ok=True)
    host = "127.0.0.1"
    ncpu = os.cpu_count() or 1
    specs = [EngineSpec(name=f"engine-{i}", model_path=str(model_path), host=host, port=p.port,
                        nccl_port=p.nccl_port, log_path=log_dir / f"engine-{i}.log", api_key=api_key,
                        dtype="float32", device="cpu", cpu_core=i % ncpu, max_total_tokens=8192,
                        extra_args=("--random-seed", str(i), *extra_args))
             for i, p in enumerate(engine_port_block(host, 2))]
    router = RouterProcess(host=host, port=free_port(host), log_path=log_dir / "router.log", api_key=api_key,
                           health_check_interval_s=2)
    dep = Deployment(model_path=model_path, api_key=api_key, router=router, supervisor=None, log_dir=log_dir)

    def changed(infos: list) -> None:
        dep.changes.append(infos)
        if on_change is not None:
            on_change(infos)

    sup = EngineSupervisor(specs, router, health_interval_s=1.0, health_timeout_s=3.0, unhealthy_after=2,
                           start_timeout_s=300, restart_backoff_s=2.0, on_change=changed,
                           on_restart=dep.restarts.append)
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
