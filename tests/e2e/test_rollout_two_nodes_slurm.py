"""A rollout group of two nodes on the real SLURM test cluster: `rlslurm submit --nodes 3
--trainer-nodes 1 --rollout-nodes 2` puts one SGLang server on each rollout node; node 0 also runs
the router and the driver, node 1 finds the router through control/router.json and registers its
engine there. Both engines must serve rollouts (the router round-robins) and follow every weight
sync (the group spans the trainer and both nodes' engines).

Kept short (4 rollouts, tiny-qwen3): what it proves is the multi-node wiring, not learning.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rlslurm.demo_task import make_prompts

from tests.e2e.helpers import batch_log, probes
from tests.slurm_runs import env_reports, ledger, rlslurm

pytestmark = [pytest.mark.slurm, pytest.mark.sglang, pytest.mark.megatron, pytest.mark.slow]

NUM_ROLLOUT = 4
ROLLOUT_BATCH, N_SAMPLES = 8, 4  # tiny-qwen3's defaults
GENERATE = re.compile(r'"POST /generate HTTP/1\.1" 200')


def test_two_rollout_nodes_serve_and_sync(slurm_cluster, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    prompts = make_prompts(tmp_path / "prompts.jsonl", n=64)
    rlslurm("submit", "--model", "tiny-qwen3", "--nodes", "3", "--trainer-nodes", "1", "--rollout-nodes", "2",
            "--engines-per-node", "1", "--prompt-data", str(prompts), "--run-dir", str(run_dir),
            "--gpus-per-node", "2", "--no-exclusive", "--cpus-per-node", "2", "--time", "30",
            "--signal-grace-s", "120", "--custom-rm-path", "rlslurm.demo_task:reward",
            "--num-rollout", str(NUM_ROLLOUT), "--num-epoch", "100", "--rollout-dtype", "float32",
            "--weight-sync", "distributed", "--verify-weight-sync", "--no-use-distributed-optimizer",
            "--engine-health-interval-s", "2")
    job = int(json.loads((run_dir / "jobs.json").read_text())["jobs"][-1]["job_id"])
    info = slurm_cluster.wait_finished(job, 15 * 60)
    assert info["JobState"] == "COMPLETED", batch_log(run_dir, job)
    assert [(l["attempt"], l["reason"]) for l in ledger(run_dir)] == [(0, "finished")]

    # one rollout process per rollout node, on two different SLURM nodes
    reports = env_reports(run_dir, 0)
    assert {"rollout-0", "rollout-1"} <= set(reports), sorted(reports)
    nodes = {reports[r]["node"] for r in ("rollout-0", "rollout-1")}
    assert len(nodes) == 2, nodes

    # node 0 merged both nodes' records into engines.json: one engine per node, healthy, never restarted
    engines = json.loads((run_dir / "control" / "engines.json").read_text())["engines"]
    assert sorted(e["node"] for e in engines) == sorted(nodes), engines
    assert all(e["healthy"] and e["restarts"] == 0 for e in engines), engines
    assert len({e["url"] for e in engines}) == 2

    # both engines served the driver's requests (round robin: ~half each of 4 x 8 x 4 samples)
    logs = run_dir / "logs" / "attempt-0"
    served = {p.name: len(GENERATE.findall(p.read_text())) for p in sorted(logs.glob("engine-*-0.log"))}
    assert sorted(served) == ["engine-0-0.log", "engine-1-0.log"], served
    total = NUM_ROLLOUT * ROLLOUT_BATCH * N_SAMPLES
    # each also answers SGLang's start-up warm-up and one weight probe per version: neither
    # comes near a quarter of the rollout requests
    assert all(n >= total // 4 for n in served.values()), served
    assert sum(served.values()) >= total, served

    # every rollout committed and trained once; after every sync both engines served the new version
    finished = json.loads((run_dir / "FINISHED").read_text())
    assert finished["trained_rollouts"] == NUM_ROLLOUT and finished["weight_version"] == NUM_ROLLOUT
    recs = probes(run_dir)
    assert [r["version"] for r in recs] == list(range(1, NUM_ROLLOUT + 1))
    assert all(r["match"] and len(r["engines"]) == 2 for r in recs), recs
