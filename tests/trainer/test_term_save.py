"""The checkpoint on SIGTERM under the real trainer command (rlslurm.slurm.torchrun, as the batch
script and `rlslurm run` start it), with a save slower than torchrun's default shutdown timeout
(30 s): the save is held by the test hook RLSLURM_TEST_SAVE_DELAY_S,
standing in for a real model's save (rlslurm/trainer/checkpoint/writer.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import GRACE_S, commit_rollouts, kill_tree, make_run, start_attempt_trainer as start, wait_trained

from rlslurm.trainer.checkpoint.writer import TEST_SAVE_DELAY_ENV

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

TRAIN = dict(save_interval=None, num_steps_per_rollout=1, global_batch_size=8, micro_batch_size=2, weight_sync="disk")






def term_once(proc: subprocess.Popen) -> None:
    """SIGTERM to every process of the tree, once, as slurmstepd ends a step (scancel, requeue,
    preemption): torchrun forwards it to its workers and, torch's default, KILLs them 30 s later."""
    import psutil

    root = psutil.Process(proc.pid)
    for p in [root, *root.children(recursive=True)]:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass


def test_term_save_longer_than_30s_completes_and_acks(tmp_path: Path, tiny_hf: Path) -> None:
    run = make_run(tmp_path / "run", tiny_hf, nproc=2, train=TRAIN, rollout=dict(num_rollout=4))
    commit_rollouts(run, range(2))
    log = tmp_path / "trainer.log"
    proc = start(run, log, {TEST_SAVE_DELAY_ENV: "35"})
    try:
        wait_trained(run, proc, log, 2)  # 2 rollouts x 1 step; rollout 2 never comes
        time.sleep(1.0)
        t0 = time.monotonic()
        term_once(proc)
        proc.wait(timeout=GRACE_S)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    text = log.read_text()
    assert "forcefully exiting" not in text, text[-6000:]  # torchrun's KILL of a worker
    ack = json.loads((run / "control" / "preempt_ack.json").read_text())
    assert ack["checkpoint_iteration"] == 2, text[-6000:]
    assert json.loads((run / "checkpoints" / "latest").read_text())["name"] == "iter_0000002"
    assert took > 35, took  # the save really outlasted torchrun's 30 s default
