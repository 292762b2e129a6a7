"""Two real CPU SGLang engines (fp32, one core each) behind the real sglang-router, under the
real EngineSupervisor (tests/helpers/sglang_deploy.py), publishing themselves into a run directory's
control/engines.json the way the rollout node does, with the rollout node's `UpdateWatcher`
holding the supervisor's health checks while control/weight_update.json is active.

Module-scoped (the engine tests restart engines); torn down by process group, checked empty.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from rlslurm.engines.receiver import LOADER as RECEIVER_LOADER
from tests.helpers.sglang_deploy import deploy

WATCH_CAP_S = 60.0  # the rollout node's cap is --weight-sync-timeout-s + PAUSE_MARGIN_S


@dataclass
class Engines:
    run_dir: Path
    model_path: Path
    api_key: str
    control: object      # Control
    router: object       # RouterProcess
    supervisor: object   # EngineSupervisor
    watcher: object      # rlslurm.engines.update_watch.UpdateWatcher


@pytest.fixture(scope="module")
def engines(tmp_path_factory, tiny_model) -> Engines:
    from rlslurm.buffer.control import Control
    from rlslurm.buffer.rundir import RunDir
    from rlslurm.engines.supervisor import control_publisher
    from rlslurm.engines.update_watch import UpdateWatcher

    run = RunDir.create(tmp_path_factory.mktemp("wsync") / "run")
    control = Control(run)
    # 0.05 (sglang_cpu's default) fails start-up when other processes take memory while the
    # server profiles it (seen on the shared 2-core box).
    with deploy(tiny_model, run.attempt_log_dir(0), api_key=run.ensure_api_key(),
                extra_args=("--weight-version", "0", "--mem-fraction-static", "0.2",
                            "--custom-weight-loader", RECEIVER_LOADER),
                on_change=control_publisher(control, "node0")) as dep:
        # polls faster than the node's default: the test asserts it saw a ~50 ms tiny-model sync
        watcher = UpdateWatcher(control, dep.supervisor, cap_s=WATCH_CAP_S, poll_s=0.01).start()
        try:
            yield Engines(run_dir=run.path, model_path=tiny_model, api_key=dep.api_key, control=control,
                          router=dep.router, supervisor=dep.supervisor, watcher=watcher)
        finally:
            watcher.close()
