"""Shared by the e2e tests whose run the test itself ends (tests/e2e/test_weight_sync_faults_slurm.py,
test_engine_span_slurm.py): the GRPO submission with a --num-rollout that is only a ceiling (the test
stops the run with `rlslurm stop` once it has seen what it waits for), bounded waits that fail with
the job's logs, the fault injection point between two syncs, and the checks after the stop."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests.e2e.helpers import batch_log, probes
from tests.helpers.slurm_runs import ledger, rlslurm

NUM_ROLLOUT = 500      # a ceiling, never reached: the test stops the run


def submit(run_dir: Path, prompts: Path, *extra: str) -> int:
    rlslurm("submit", "--model", "tiny-qwen3", "--nodes", "2", "--prompt-data", str(prompts), "--run-dir", str(run_dir),
            "--gpus-per-node", "2", "--no-exclusive", "--cpus-per-node", "2", "--time", "30", "--signal-grace-s", "120",
            "--custom-rm-path", "rlslurm.demo_task:reward", "--num-rollout", str(NUM_ROLLOUT), "--num-epoch", "100",
            "--rollout-dtype", "float32", "--weight-sync", "distributed", "--verify-weight-sync",
            "--no-use-distributed-optimizer", "--save-interval", str(NUM_ROLLOUT),
            "--engine-health-interval-s", "2", *extra)
    return int(json.loads((run_dir / "jobs.json").read_text())["jobs"][-1]["job_id"])


def wait_for(cond, timeout: float, what: str, run_dir: Path, job: int, poll: float = 0.2):
    """Poll `cond` until truthy; fail at the timeout, or at once when the job has failed."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        failed = any(l["attempt"] == 0 and l["reason"] != "finished" for l in ledger(run_dir))
        if failed or time.monotonic() > deadline:
            why = "the job's first attempt ended" if failed else f"timed out after {timeout:g} s"
            raise AssertionError(f"{why} waiting for {what}\n{batch_log(run_dir, job)[-3000:]}"
                                 f"\n{_tail(run_dir / 'logs/attempt-0/rollout-0.log')}"
                                 f"\n{_tail(run_dir / 'logs/attempt-0/trainer-0.log')}")
        time.sleep(poll)


def _tail(p: Path, n: int = 4000) -> str:
    return p.read_text(errors="replace")[-n:] if p.exists() else f"({p} missing)"


def last_probe(run_dir: Path) -> int:
    return max((r["version"] for r in probes(run_dir)), default=0)


def stop_and_check(slurm_cluster, run_dir: Path, job: int) -> tuple[list[int], int]:
    """`rlslurm stop`, wait for the job, and check that it ended COMPLETED with every rollout
    the trainer took trained exactly once, in order, by the one attempt (metrics.jsonl has one
    line per optimizer step). Returns the trained ids and the last version synced before the
    stop: once the stop is requested no publish begins and one in flight is given up (the checkpoint
    carries its version), and the rollout node kills its engines."""
    before_stop = last_probe(run_dir)
    rlslurm("stop", str(run_dir))
    info = slurm_cluster.wait_finished(job, 10 * 60)
    assert info["JobState"] == "COMPLETED", batch_log(run_dir, job)
    assert [(l["attempt"], l["reason"]) for l in ledger(run_dir)] == [(0, "stopped by request")]
    ids: list[int] = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        assert rec["attempt"] == 0, rec
        if not ids or ids[-1] != rec["rollout_id"]:
            ids.append(rec["rollout_id"])
    assert ids == list(range(len(ids))), ids
    # synchronous RL: at most the rollout in flight at the stop was committed and not trained (the
    # stop's checkpoint lets buffer retention retire the oldest trained ones, hence no lower bound)
    committed = sorted(int(p.name.split(".")[0]) for p in (run_dir / "buffer" / "train").glob("*.manifest.json"))
    assert [c for c in committed if c >= len(ids)] in ([], [len(ids)]), (committed, ids)
    assert committed and committed == list(range(committed[0], committed[-1] + 1)), (committed, ids)
    return ids, before_stop


def at_next_commit(run_dir: Path, job: int) -> int:
    """Block until the next rollout is committed; returns its id k. In synchronous RL nothing is
    generated between the commit of rollout k and the sync of version k+1 (the driver waits for
    it), so a fault injected now meets that sync first, not a generation request."""
    def manifest(k: int) -> Path:
        return run_dir / "buffer" / "train" / f"{k:08d}.manifest.json"

    k = last_probe(run_dir)
    while manifest(k).exists():  # committed already: its sync may be under way; take the next one
        k += 1
    wait_for(manifest(k).exists, 120, f"rollout {k} committed", run_dir, job, poll=0.01)
    # version k's probe runs while rollout k is generated (both follow sync k): let it finish, or a
    # fault injected now is seen by that probe instead of by sync k+1
    wait_for(lambda: last_probe(run_dir) >= k, 120, f"probe of version {k}", run_dir, job, poll=0.01)
    return k


def check_no_stale_samples(run_dir: Path) -> None:
    lines = [json.loads(l) for l in (run_dir / "rollout_metrics.jsonl").read_text().splitlines()]
    train = [(l["rollout_id"], l["rollout/weight_version_min"], l["rollout/weight_version_max"])
             for l in lines if l["kind"] == "train"]
    assert train and all(lo == hi == rid for rid, lo, hi in train), [t for t in train if not t[0] == t[1] == t[2]]
