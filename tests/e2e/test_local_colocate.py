"""`rlslurm run --demo --colocate` end to end on the CPU stack (docs/colocate.md): the trainer (two
ranks under torchrun) and two real SGLang engines take turns, and every publish reaches the engines in
place (--weight-sync-transport ipc, the default with --colocate: each engine maps its trainer rank's
memfd). After every sync both engines serve the trainer's version and its greedy tokens; every rollout
records the turn's phases. The GPU tier runs the same with CUDA IPC, a kill -9 and a resume
(tests/gpu/test_gpu_grpo.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.megatron, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
NUM_ROLLOUT = 3


def test_demo_colocated_takes_turns_and_every_sync_is_read_in_place(tmp_path: Path) -> None:
    run_dir, log = tmp_path / "demo", tmp_path / "run.log"
    cmd = [sys.executable, "-m", "rlslurm.cli", "run", "--demo", "--colocate", "--run-dir", str(run_dir),
           "--no-progress", "--num-rollout", str(NUM_ROLLOUT), "--rollout-batch-size", "8", "--verify-weight-sync"]
    with open(log, "wb") as out:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=900).returncode
    text = log.read_text()
    assert rc == 0, text[-4000:]
    assert json.loads((run_dir / "FINISHED").read_text())["trained_rollouts"] == NUM_ROLLOUT

    probes = [json.loads(l) for l in (run_dir / "control" / "weight_probe.jsonl").read_text().splitlines()]
    assert {p["version"] for p in probes} >= set(range(1, NUM_ROLLOUT + 1)), probes
    assert all(p["match"] and len(p["engines"]) == 2 for p in probes), probes

    metrics = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    phases = {m["rollout_id"] for m in metrics if {"time/engines_release", "time/onload", "time/publish"} <= set(m)}
    assert phases == set(range(NUM_ROLLOUT)), metrics[-1]

    logs = run_dir / "logs" / "attempt-0"
    trainer = "".join(p.read_text() for p in logs.glob("trainer-*.log"))
    assert trainer.count("copied in place to 2 engine(s)") >= NUM_ROLLOUT and " broadcast to " not in trainer
    engines = [p.read_text() for p in sorted(logs.glob("engine-*.log"))]
    assert len(engines) == 2 and all(e.count("read in place") >= NUM_ROLLOUT for e in engines)
