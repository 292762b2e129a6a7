"""PPO with a critic under TP=2 through the entry point: critic-only warm-up, then actor and
critic steps with finite losses and the full metric set; a preempt request while waiting for a
rollout checkpoints (critic included), acknowledges and exits 0, and the next attempt resumes. The
prompts run out before the last rollout (the driver's control/data_exhausted.json): the trainer
trains what came before it and marks the run FINISHED with the reason."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, commit_rollouts, free_port, make_run, metrics, run_trainer

from rlslurm.attempt import clear_stale
from rlslurm.buffer import Control, RunDir
from rlslurm.buffer.atomic import write_json_atomic

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

TRAIN = dict(advantage_estimator="ppo", num_critic_only_steps=1, critic_lr=2e-3, normalize_advantages=True,
             gamma=1.0, lambd=0.95, tensor_model_parallel_size=2, num_steps_per_rollout=2, global_batch_size=4,
             micro_batch_size=2, use_dynamic_batch_size=True, max_tokens_per_gpu=24, weight_sync="distributed",
             weight_sync_timeout_s=20)


def test_ppo_critic_preempt_and_resume(tmp_path: Path, tiny_hf: Path) -> None:
    run = make_run(tmp_path / "run", tiny_hf, nproc=2, train=TRAIN, rollout=dict(num_rollout=4))
    commit_rollouts(run, range(1))
    log = tmp_path / "attempt0.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "-m", "rlslurm.trainer.main", "--run-dir", str(run)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while not (run / "metrics.jsonl").exists() or len(metrics(run)) < 2:
            assert proc.poll() is None, log.read_text()[-6000:]
            assert time.monotonic() < deadline, log.read_text()[-6000:]
            time.sleep(0.3)
        write_json_atomic(run / "control" / "preempt.json", {"signal": "USR1", "at": time.time()})
        assert proc.wait(timeout=120) == 0, log.read_text()[-6000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    ack = Control(run).preempt_ack()
    assert ack is not None and ack.checkpoint_iteration == 1
    meta = json.loads((run / "checkpoints" / "iter_0000001" / "rlslurm.json").read_text())
    assert meta["progress"]["next_rollout_id"] == 1 and not (run / "FINISHED").exists()

    warm = metrics(run)
    assert [l["rollout_id"] for l in warm] == [0, 0]
    for l in warm:  # critic-only warm-up: the actor did not step
        assert "pg_loss" not in l and math.isfinite(l["value_loss"]) and l["critic_grad_norm"] > 0

    clear_stale(RunDir(run))  # as the next attempt's start does
    commit_rollouts(run, range(1, 3))
    Control(run).mark_data_exhausted(3, attempt=0, message="the prompt data ran out in rollout 3")
    p = run_trainer(run, nproc=2)
    assert "resumed from" in p.stderr
    info = RunDir(run).finished_info()
    assert info["trained_rollouts"] == 3 and info["ended_early"] == "the prompt data ran out in rollout 3"
    assert "run FINISHED after 3 rollouts: the prompt data ran out" in p.stderr
    assert json.loads((run / "checkpoints" / "latest").read_text())["iteration"] == 3  # saved at the end
    lines = [l for l in metrics(run) if l["rollout_id"] >= 1]
    assert [l["step"] for l in lines] == [2, 3, 4, 5]
    for l in lines:
        for k in ("loss", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "grad_norm", "value_loss", "value_clipfrac",
                  "critic_grad_norm", "lr", "critic_lr", "reward_mean", "truncation_rate", "tokens_per_s"):
            assert l.get(k) is not None and math.isfinite(l[k]), (k, l)
    # weight_sync=distributed with no engine registered: nothing is published, and nothing falls back
    # to disk (issue 30: a fallback where nothing failed is a bug); the versions wait for engines
    assert not (run / "control" / "weight_version.json").exists() and not list((run / "weights").glob("v*"))
    assert "WEIGHT SYNC FALLBACK" not in p.stderr
    assert "will be published once this attempt's engines are up" in p.stderr
