"""Two real CPU SGLang engines (fp32, one core each) behind the real sglang-router, under the
real EngineSupervisor, publishing themselves into a run directory's control/engines.json the way
the rollout node does. `UpdateWatcher` is the rollout-side half of the weight-update bracket:
while control/weight_update.json is fresh it holds `pause_health_checks()`.

Module-scoped (the engine tests restart engines); torn down by process group, checked empty.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.process_groups import teardown_deployment


@dataclass
class Engines:
    run_dir: Path
    model_path: Path
    api_key: str
    control: object      # Control
    router: object       # RouterProcess
    supervisor: object   # EngineSupervisor
    watcher: "UpdateWatcher"


class UpdateWatcher:
    """Hold the supervisor's health checks while the trainer says it is updating weights."""

    def __init__(self, control, supervisor, poll_s: float = 0.01):  # a tiny-model sync takes ~50 ms
        self.control, self.supervisor, self.poll_s = control, supervisor, poll_s
        self.held = 0  # how many update brackets were honoured (asserted by the tests)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="update-watcher", daemon=True)

    def start(self) -> "UpdateWatcher":
        self._thread.start()
        return self

    def _run(self) -> None:
        from rlslurm.trainer.weight_sync import update_in_progress

        while not self._stop.wait(self.poll_s):
            if update_in_progress(self.control):
                self.held += 1
                with self.supervisor.pause_health_checks():
                    while update_in_progress(self.control) and not self._stop.wait(self.poll_s):
                        pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from rlslurm.model_config import load_model_config
    from rlslurm.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(load_model_config("tiny-qwen3"), tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="module")
def engines(tmp_path_factory, tiny_model) -> Engines:
    with deploy(tmp_path_factory, tiny_model) as e:
        yield e


@contextlib.contextmanager
def deploy(tmp_path_factory, tiny_model: Path):
    from rlslurm.rollout import sglang_cpu

    if sglang_cpu.installed_sglang_version() is None:
        pytest.skip("sglang is not installed (tools/install.sh installs it)")
    from rlslurm.buffer.control import Control
    from rlslurm.buffer.rundir import RunDir
    from rlslurm.net import engine_port_block, free_port
    from rlslurm.rollout.engine import EngineSpec
    from rlslurm.rollout.router import RouterProcess
    from rlslurm.rollout.supervisor import EngineSupervisor, control_publisher

    run = RunDir.create(tmp_path_factory.mktemp("wsync") / "run")
    key = run.ensure_api_key()
    control = Control(run)
    logs = run.attempt_log_dir(0)
    logs.mkdir(parents=True, exist_ok=True)
    host = "127.0.0.1"
    ncpu = os.cpu_count() or 1
    specs = [EngineSpec(name=f"engine-{i}", model_path=str(tiny_model), host=host, port=p.port, nccl_port=p.nccl_port,
                        log_path=logs / f"engine-{i}.log", api_key=key, dtype="float32", device="cpu",
                        cpu_core=i % ncpu, max_total_tokens=8192,
                        # 0.05 (sglang_cpu's default) fails start-up when other processes take
                        # memory while the server profiles it (seen on the shared 2-core box).
                        extra_args=("--random-seed", str(i), "--weight-version", "0",
                                    "--mem-fraction-static", "0.2"))
             for i, p in enumerate(engine_port_block(host, 2))]
    router = RouterProcess(host=host, port=free_port(host), log_path=logs / "router.log", api_key=key,
                           health_check_interval_s=2)
    sup = EngineSupervisor(specs, router, health_interval_s=1.0, health_timeout_s=3.0, unhealthy_after=2,
                           start_timeout_s=300, restart_backoff_s=2.0,
                           on_change=control_publisher(control, "node0"))
    router.start()
    try:
        sup.start()
    except BaseException:
        router.close()
        raise
    watcher = UpdateWatcher(control, sup).start()
    try:
        yield Engines(run_dir=run.path, model_path=tiny_model, api_key=key, control=control, router=router,
                      supervisor=sup, watcher=watcher)
    finally:
        watcher.close()
        teardown_deployment(sup, router)
