"""Shared by the e2e GRPO tests on the SLURM test cluster: the tiny GRPO submission and readers
of what its run leaves behind (batch log, weight probes, the trainer's per-attempt record)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers.slurm_runs import rlslurm

GRPO_NUM_ROLLOUT = 24  # submit_grpo's --num-rollout; a later --num-rollout in `extra` wins


def submit_grpo(run_dir: Path, prompts: Path, *extra: str) -> int:
    rlslurm("submit", "--model", "tiny-qwen3", "--nodes", "2", "--prompt-data", str(prompts), "--run-dir", str(run_dir),
            "--gpus-per-node", "2", "--no-exclusive", "--cpus-per-node", "2", "--time", "30", "--signal-grace-s", "120",
            "--custom-rm-path", "rlslurm.demo_task:reward", "--num-rollout", str(GRPO_NUM_ROLLOUT),
            "--num-epoch", "100",
            "--rollout-dtype", "float32", "--weight-sync", "distributed", "--verify-weight-sync",
            "--no-use-distributed-optimizer", "--save-interval", "4", "--engine-health-interval-s", "2", *extra)
    return int(json.loads((run_dir / "jobs.json").read_text())["jobs"][-1]["job_id"])


def probes(run_dir: Path) -> list[dict]:
    p = run_dir / "control" / "weight_probe.jsonl"
    return [json.loads(l) for l in p.read_text().splitlines()] if p.exists() else []


def batch_log(run_dir: Path, job: int) -> str:
    p = run_dir / f"logs/slurm-{job}.out"
    return p.read_text() if p.exists() else ""


def trained_per_attempt(run_dir: Path) -> dict[int, list[int]]:
    """The trainer's record: per attempt, the rollout ids it trained, in order."""
    out: dict[int, list[int]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        ids = out.setdefault(rec["attempt"], [])
        if not ids or ids[-1] != rec["rollout_id"]:
            ids.append(rec["rollout_id"])
    return out
