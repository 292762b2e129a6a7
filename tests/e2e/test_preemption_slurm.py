"""Preemption by SLURM itself: a tiny GRPO run in the test cluster's `preemptible` partition
(PreemptMode=REQUEUE, GraceTime) is preempted by a job in `urgent` (higher PriorityTier) that needs
every node. SLURM TERMs the run's steps (not its batch shell: docs/slurm-preemption.md); the
trainer checkpoints on that TERM with megatron's writer helpers TERMed too, the batch shell waits
for the ack and requeues, and the resumed run finishes with every rollout trained exactly once.

`scancel --signal=TERM --batch` and the hard `scontrol requeue` are covered elsewhere
(tests/launcher/test_slurm_job.py, tests/e2e/test_grpo_slurm.py).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from rlslurm.curve import reward_curve
from rlslurm.demo_task import make_prompts

from tests.e2e.helpers import batch_log, submit_grpo, trained_per_attempt
from tests.slurm_runs import ledger, wait_reports

pytestmark = [pytest.mark.slurm, pytest.mark.sglang, pytest.mark.megatron, pytest.mark.slow]

NUM_ROLLOUT = 6
SAVE_INTERVAL = 2  # a periodic save comes before the preemption, as in a real run


def test_preemption_by_a_higher_priority_partition_loses_nothing(slurm_cluster, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    prompts = make_prompts(tmp_path / "prompts.jsonl", n=64)
    job = submit_grpo(run_dir, prompts, "--partition", "preemptible", "--num-rollout", str(NUM_ROLLOUT),
                      "--save-interval", str(SAVE_INTERVAL))
    deadline = time.monotonic() + 600
    while len(reward_curve(run_dir)) < SAVE_INTERVAL + 1:  # past the first periodic save
        assert time.monotonic() < deadline, f"rollouts not trained: {batch_log(run_dir, job)}"
        time.sleep(0.5)
    nodes = re.search(r"TotalNodes=(\d+)", slurm_cluster.run("scontrol", "show", "partition", "urgent", "-o").stdout)
    urgent = int(slurm_cluster.run("sbatch", "--parsable", "--partition=urgent", "--exclusive", f"--nodes={nodes[1]}",
                                   f"--output={tmp_path}/urgent-%j.out", "--wrap", "sleep 1").stdout.strip())
    assert slurm_cluster.wait_finished(urgent, 300)["JobState"] == "COMPLETED"
    wait_reports(run_dir, 1, {"trainer-0", "trainer-1", "rollout-0"}, timeout=300)
    info = slurm_cluster.wait_finished(job, 15 * 60)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", batch_log(run_dir, job)

    # the ledger shows the preemption, with the trainer's checkpoint acknowledged before the requeue
    assert [(l["attempt"], l["reason"]) for l in ledger(run_dir)] == [
        (0, "preempted (SIGTERM: SLURM preemption); checkpoint acknowledged"), (1, "finished")], batch_log(run_dir, job)

    steps = trained_per_attempt(run_dir)
    assert sorted(steps) == [0, 1], steps
    # The TERM's checkpoint holds everything attempt 0 trained (a periodic one when the TERM came
    # right after it): attempt 1 resumes from it, and nothing is lost or trained twice.
    last = steps[0][-1] + 1
    log0 = (run_dir / "logs/attempt-0/trainer-0.log").read_text()
    term = log0.index("SIGTERM")
    assert f"preempt: checkpoint {last} acknowledged" in log0[term:], log0[-4000:]
    if last % SAVE_INTERVAL:
        assert f"saved checkpoint {run_dir}/checkpoints/iter_{last:07d}" in log0[term:], log0[-4000:]
    log1 = (run_dir / "logs/attempt-1/trainer-0.log").read_text()
    assert f"resumed from {run_dir}/checkpoints/iter_{last:07d}: next rollout {last}," in log1, log1[-4000:]
    assert steps[0] == list(range(last)) and steps[1] == list(range(last, NUM_ROLLOUT)), steps
    finished = json.loads((run_dir / "FINISHED").read_text())
    assert finished["trained_rollouts"] == NUM_ROLLOUT
