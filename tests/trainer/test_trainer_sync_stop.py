"""A stop while the trainer's weight sync waits on an engine that never answers (issue 30: a Ctrl-C 3 s into
a failing sync was answered "up to 300 s" and the attempt ran on for 5 minutes). The trainer (torchrun,
2 gloo ranks, real megatron-core) gives the sync up within seconds, checkpoints what it trained, acks the
stop and exits 0; the next attempt publishes that version. Its phase record said what it was waiting on."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from conftest import commit_rollouts, kill_tree, make_run, metrics, start_trainer

from rlslurm.buffer.control import Control, EngineRecord
from rlslurm.buffer.rundir import RunDir

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

SYNC_TIMEOUT_S = 120.0


def test_a_stop_gives_up_a_hung_weight_sync_and_checkpoints(tmp_path: Path, tiny_hf: Path) -> None:
    run = make_run(tmp_path / "run", tiny_hf, nproc=2, rollout=dict(num_rollout=3),
                   train=dict(weight_sync="distributed", weight_sync_timeout_s=SYNC_TIMEOUT_S, save_interval=100))
    control = Control(RunDir(run))
    hung = socket.socket()  # accepts connections, answers nothing: a SIGSTOPped engine as the kernel shows it
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)
    control.write_engines([EngineRecord(url=f"http://127.0.0.1:{hung.getsockname()[1]}", node="n0", healthy=True)])
    commit_rollouts(run, range(1))
    proc = start_trainer(run, tmp_path / "trainer.log")
    try:
        deadline = time.monotonic() + 240

        def syncing() -> bool:
            hb = next((h for h in control.heartbeats() if h.role == "trainer" and h.rank == 0), None)
            return hb is not None and (hb.phase or "").startswith("weight sync v1 (gloo): try 1/2")

        while not syncing():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "trainer.log").read_text()[-4000:]
            time.sleep(0.2)
        t0 = time.monotonic()
        control.request_stop("test: a stop during a hung sync")
        assert proc.wait(timeout=SYNC_TIMEOUT_S) == 0, (tmp_path / "trainer.log").read_text()[-4000:]
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            kill_tree(proc)
        hung.close()
    log = (tmp_path / "trainer.log").read_text()
    assert took < 30, f"the stop waited {took:.0f} s for the sync (its timeout: {SYNC_TIMEOUT_S:.0f} s)"
    assert "v1: given up, the job is ending" in log and "WEIGHT SYNC FALLBACK" not in log, log[-3000:]
    ack = control.stop_ack()
    assert ack is not None and ack.checkpoint_iteration == 1  # rollout 0 trained and saved
    assert [m["rollout_id"] for m in metrics(run)] == [0, 0]  # its metrics kept (2 steps per rollout)
    assert control.weight_version() is None and not control.weight_update_file.exists()
