"""The vertical slice on the real SLURM test cluster: `rlslurm submit` of a tiny model runs GRPO
(trainer: 2 gloo ranks under torchrun in het-group 0; 2 real SGLang servers + sglang-router + driver
in het-group 1, on one or two rollout nodes), weights synced over a torch.distributed group after
every rollout, reward rising; and the same run interrupted three ways loses nothing.

Margin: on the toy task (`rlslurm.demo_task`) a random-init tiny-qwen3 starts at ~0.3 mean reward
and, with lr 3e-3, reached 0.76 mean over rollouts 16-20 in a measured local run (0.27 -> 0.84 by
rollout 20). We assert the last 5 of 24 rollouts beat the first 5 by more than 0.15: half the
measured gain, well above the rollout-to-rollout noise (~0.1).
"""

from __future__ import annotations

import json
import re
import statistics
import time
from pathlib import Path

import pytest

from rlslurm.curve import reward_curve
from rlslurm.demo_task import make_prompts

from tests.deliveries import assert_delivered_by
from tests.e2e.helpers import GRPO_NUM_ROLLOUT, batch_log, probes, submit_grpo, trained_per_attempt
from tests.slurm_runs import env_reports, ledger, rlslurm, wait_reports

pytestmark = [pytest.mark.slurm, pytest.mark.sglang, pytest.mark.megatron, pytest.mark.slow]

NUM_ROLLOUT = GRPO_NUM_ROLLOUT
MARGIN = 0.15


ROLLOUT_BATCH, N_SAMPLES = 8, 4  # tiny-qwen3's defaults
GENERATE = re.compile(r'"POST /generate HTTP/1\.1" 200')


def test_grpo_learns_and_engines_on_two_rollout_nodes_follow_every_sync(slurm_cluster, tmp_path: Path) -> None:
    """The rollout group spans two nodes (`--nodes 3 --trainer-nodes 1 --rollout-nodes 2
    --engines-per-node 1`): node 0 runs the router, the driver and one engine; node 1 finds the
    router through control/router.json and registers its engine there. Both engines serve
    rollouts (the router round-robins) and every weight sync reaches both (the group spans the
    trainer and both nodes' engines)."""
    run_dir = tmp_path / "run"
    prompts = make_prompts(tmp_path / "prompts.jsonl", n=64)
    job = submit_grpo(run_dir, prompts, "--nodes", "3", "--trainer-nodes", "1", "--rollout-nodes", "2",
                      "--engines-per-node", "1")
    info = slurm_cluster.wait_finished(job, 20 * 60)
    assert info["JobState"] == "COMPLETED", batch_log(run_dir, job)
    curve = reward_curve(run_dir)
    assert [r for r, _ in curve] == list(range(NUM_ROLLOUT))
    first, last = statistics.mean(v for _, v in curve[:5]), statistics.mean(v for _, v in curve[-5:])
    assert last - first > MARGIN, f"reward did not rise: first5 {first:.3f} last5 {last:.3f}: {curve}"
    recs = probes(run_dir)
    # one probe per published version (1..NUM_ROLLOUT), every engine at the trainer's version, same greedy tokens
    assert [r["version"] for r in recs] == list(range(1, NUM_ROLLOUT + 1))
    bad = [r for r in recs if not r["match"]]
    assert not bad, bad[:2]
    assert all(len(r["engines"]) == 2 for r in recs)
    # ... each delivered by the gloo broadcast group at its first try (the disk fallback gives the same probes)
    assert all(d["tries"] == 1 for d in assert_delivered_by(run_dir, "gloo", versions=set(range(1, NUM_ROLLOUT + 1))))
    assert [(l["attempt"], l["reason"]) for l in ledger(run_dir)] == [(0, "finished")]

    # one rollout process per rollout node, on two different SLURM nodes
    reports = env_reports(run_dir, 0)
    assert {"rollout-0", "rollout-1"} <= set(reports), sorted(reports)
    nodes = {reports[r]["node"] for r in ("rollout-0", "rollout-1")}
    assert len(nodes) == 2, nodes
    # the trainer group on a node of its own, seeing its own het-group node list; its two ranks one
    # torch.distributed world, at the trainer head's address the rollout side knows; GPUs from the
    # (fake) gres of each group
    t0, t1, r0 = reports["trainer-0"], reports["trainer-1"], reports["rollout-0"]
    g0 = t0["nodelist_het"]["0"]
    assert t0["node"] == t1["node"] == g0 and g0 not in nodes, reports
    assert t0["world_size"] == 2 and t0["master_addr"] == r0["trainer_addr"] == "127.0.0.1"
    assert t0["cuda_visible_devices"] == "0,1" and r0["cuda_visible_devices"] == "0,1"
    st = json.loads(rlslurm("status", str(run_dir), "--json").stdout)
    assert st["job_id"] == str(job) and st["finished"] is True and st["slurm"]["state"] == "COMPLETED", st
    assert len(st["slurm"]["components"]) == 2 and len(st["attempts"]) == 1
    assert oct(run_dir.stat().st_mode & 0o777) == "0o700"
    assert oct((run_dir / "control/api_key").stat().st_mode & 0o777) == "0o600"
    # node 0 merged both nodes' records into engines.json: one engine per node, healthy, never restarted
    engines = json.loads((run_dir / "control" / "engines.json").read_text())["engines"]
    assert sorted(e["node"] for e in engines) == sorted(nodes), engines
    assert all(e["healthy"] and e["restarts"] == 0 for e in engines), engines
    assert len({e["url"] for e in engines}) == 2
    # both engines served the driver's requests (round robin: ~half each); each also answers
    # SGLang's start-up warm-up and one weight probe per version, neither near a quarter of them
    logs = run_dir / "logs" / "attempt-0"
    served = {p.name: len(GENERATE.findall(p.read_text())) for p in sorted(logs.glob("engine-*-0.log"))}
    assert sorted(served) == ["engine-0-0.log", "engine-1-0.log"], served
    total = NUM_ROLLOUT * ROLLOUT_BATCH * N_SAMPLES
    assert all(n >= total // 4 for n in served.values()) and sum(served.values()) >= total, served


INTERRUPTED_NUM_ROLLOUT = 16  # three interruptions, each after 2 more trained rollouts (a rollout ~2-5 s)
SAVE_INTERVAL = 2  # a periodic save comes before each interruption, as in a real run


def test_usr1_preemption_and_hard_requeue_lose_nothing_and_train_nothing_twice(slurm_cluster, tmp_path: Path) -> None:
    """One run in the test cluster's `preemptible` partition, interrupted three ways:

    1. USR1 to the batch shell (as `--signal=B:USR1@grace` before the time limit): checkpoint and
       self-requeue;
    2. preemption by SLURM itself: a job in `urgent` (higher PriorityTier) that needs every node.
       PreemptMode=REQUEUE with GraceTime TERMs the steps, not the batch shell
       (docs/slurm-preemption.md); the trainer checkpoints on that TERM, the batch shell waits for
       the ack, SLURM requeues;
    3. a hard `scontrol requeue` (TERM to everything, KILL after KillWait).

    Exact equality with an uninterrupted run cannot hold here: SGLang samples at temperature 1 with
    per-request randomness, so the rollouts generated after a restart differ from those an
    uninterrupted run would have generated. The test instead proves from the trainer's own record
    (the checkpointed progress and the per-step metrics of each attempt) that each rollout id was
    trained exactly once in the lineage of the final weights, and that none was lost.
    """
    run_dir = tmp_path / "run"
    prompts = make_prompts(tmp_path / "prompts.jsonl", n=64)
    job = submit_grpo(run_dir, prompts, "--partition", "preemptible", "--num-rollout", str(INTERRUPTED_NUM_ROLLOUT),
                      "--save-interval", str(SAVE_INTERVAL))
    roles = {"trainer-0", "trainer-1", "rollout-0"}

    def wait_trained(n: int, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while len(reward_curve(run_dir)) < n:
            assert time.monotonic() < deadline, f"fewer than {n} rollouts trained: {batch_log(run_dir, job)}"
            time.sleep(0.5)

    # 1. USR1
    wait_trained(2)
    slurm_cluster.signal_batch(job, "USR1")
    wait_reports(run_dir, 1, roles, timeout=300)
    first = ledger(run_dir)[0]
    assert (first["reason"], first["exit_code"]) == ("preempted (USR1)", 0), first
    assert "trainer checkpoint acknowledged" in batch_log(run_dir, job)
    assert not (run_dir / "control/preempt.json").exists()  # a new attempt starts without the old request

    # 2. preemption by a higher-priority partition, past a periodic save of attempt 1
    wait_trained(len(reward_curve(run_dir)) + SAVE_INTERVAL)
    nodes = re.search(r"TotalNodes=(\d+)", slurm_cluster.run("scontrol", "show", "partition", "urgent", "-o").stdout)
    urgent = int(slurm_cluster.run("sbatch", "--parsable", "--partition=urgent", "--exclusive", f"--nodes={nodes[1]}",
                                   f"--output={tmp_path}/urgent-%j.out", "--wrap", "sleep 1").stdout.strip())
    assert slurm_cluster.wait_finished(urgent, 300)["JobState"] == "COMPLETED"
    wait_reports(run_dir, 2, roles, timeout=300)
    assert ledger(run_dir)[1]["reason"] == "preempted (SIGTERM: SLURM preemption); checkpoint acknowledged", \
        batch_log(run_dir, job)
    # The TERM's checkpoint holds everything attempt 1 trained (a periodic one when the TERM came
    # right after it): attempt 2 resumes from it, nothing lost or trained twice.
    wait_trained(len(reward_curve(run_dir)) + 1)  # attempt 2 has resumed and trained
    steps = trained_per_attempt(run_dir)
    last = steps[1][-1] + 1
    log1 = (run_dir / "logs/attempt-1/trainer-0.log").read_text()
    term = log1.index("SIGTERM")
    assert f"preempt: checkpoint {last} acknowledged" in log1[term:], log1[-4000:]
    if last % SAVE_INTERVAL:
        assert f"saved checkpoint {run_dir}/checkpoints/iter_{last:07d}" in log1[term:], log1[-4000:]
    log2 = (run_dir / "logs/attempt-2/trainer-0.log").read_text()
    assert f"resumed from {run_dir}/checkpoints/iter_{last:07d}: next rollout {last}," in log2, log2[-4000:]
    assert steps[2][0] == last, steps

    # 3. hard requeue
    wait_trained(len(reward_curve(run_dir)) + 1)
    slurm_cluster.requeue(job)
    reps = wait_reports(run_dir, 3, roles, timeout=300)
    assert all(r["restart_count"] == 3 for r in reps.values()), reps
    # `rlslurm status` while attempt 3 runs: the three ended attempts and the current one
    st = json.loads(rlslurm("status", str(run_dir), "--json").stdout)
    assert len(st["attempts"]) == 3 and st["current_attempt"]["attempt"] == 3, st
    human = rlslurm("status", str(run_dir)).stdout  # piped: tab-separated rows, one per attempt
    rows = [l.split("\t") for l in human.splitlines()]
    assert [r[0] for r in rows if len(r) == 6 and r[0].isdigit()] == ["0", "1", "2", "3"], human
    assert rows[-1][0] == "3" and rows[-1][-1] == "running", human
    info = slurm_cluster.wait_finished(job, 20 * 60)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "3", batch_log(run_dir, job)
    for a in range(4):  # separate attempt logs
        assert (run_dir / f"logs/attempt-{a}/trainer-0.log").exists(), a
    assert "integer expression expected" not in batch_log(run_dir, job)  # the clock survives SLURM's TERM
    assert_delivered_by(run_dir, "gloo")  # each attempt's versions over the broadcast group, none by the fallback

    lines = ledger(run_dir)
    assert [l["attempt"] for l in lines] == [0, 1, 2, 3]
    assert lines[2]["reason"].startswith("terminated"), lines[2]
    assert lines[3]["reason"] == "finished"

    # The trainer's record: per attempt, the rollouts it trained.
    steps = trained_per_attempt(run_dir)
    # each attempt trains a contiguous run of ids, and resumes exactly where the checkpoint it loaded ended
    for a, ids in steps.items():
        assert ids == list(range(ids[0], ids[-1] + 1)), (a, ids)
    assert steps[1][0] == steps[0][-1] + 1, "after USR1 the trainer resumes right after its last trained rollout"
    assert steps[2][0] == steps[1][-1] + 1, "after a preemption the trainer resumes right after its last trained rollout"
    assert steps[3][0] <= steps[2][-1] + 1, "a hard requeue resumes from the last checkpoint (at or before)"
    # lineage of the final weights: each attempt up to where the next one resumed, then the last
    lineage = [i for a in (0, 1, 2) for i in steps[a] if i < steps[a + 1][0]] + steps[3]
    assert lineage == list(range(INTERRUPTED_NUM_ROLLOUT)), lineage
    finished = json.loads((run_dir / "FINISHED").read_text())
    assert finished["trained_rollouts"] == INTERRUPTED_NUM_ROLLOUT
    assert finished["weight_version"] == INTERRUPTED_NUM_ROLLOUT
    # Every published version reached the engines and matched. After a resume the trainer trains
    # rollouts already in the buffer while the new engines start, and publishes only the newest
    # version once they are up, so a version trained in that window may have no probe of its own.
    recs = probes(run_dir)
    assert recs and all(r["match"] for r in recs), [r for r in recs if not r["match"]][:2]
    versions = [r["version"] for r in recs]
    assert versions[-1] == INTERRUPTED_NUM_ROLLOUT, versions
    assert set(versions) <= set(range(1, INTERRUPTED_NUM_ROLLOUT + 1)), versions
