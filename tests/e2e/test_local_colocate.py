"""Two features end to end through `rlslurm run` on the CPU stack, in one run of
examples/tool_calling/sft_then_rl.py (one slow scenario, not two):

- the tool-calling example (issue 16): an engine-free SFT on transcripts (`--debug-train-only
  --loss-type sft_loss`), its `--save-hf` export, then GRPO from it with the example's multi-turn
  generate function (the model calls the calculator, the tool's output enters the context with loss
  mask 0) and its reward, on real SGLang engines behind the router;
- `--colocate` (issue 13, docs/colocate.md): that GRPO runs with the trainer and two real engines
  taking turns, and every publish reaches the engines in place (--weight-sync-transport ipc, the
  default with --colocate: each engine maps its trainer rank's memfd). After every sync both engines
  serve the trainer's version and its greedy tokens; every rollout records the turn's phases; the
  engines give their memory up before the run's last checkpoint.

That the example's reward rises under RL takes 20 rollouts of 128 samples (about 6 minutes): measured
in bench/results/tool-calling-cpu.md, not here. The GPU tier runs --colocate with CUDA IPC, a kill -9
and a resume (tests/gpu/test_gpu_grpo.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.deliveries import assert_delivered_by

pytestmark = [pytest.mark.sglang, pytest.mark.megatron, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
NUM_ROLLOUT = 3


def test_tool_calling_example_trains_colocated_and_every_sync_is_read_in_place(tmp_path: Path) -> None:
    work, log = tmp_path / "tool", tmp_path / "example.log"
    cmd = [sys.executable, str(ROOT / "examples" / "tool_calling" / "sft_then_rl.py"), "--work", str(work),
           "--sft-rollouts", "40", "--rl-rollouts", str(NUM_ROLLOUT), "--rl-prompts", "8", "--rl-samples", "4",
           "--rl-colocate"]
    with open(log, "wb") as out:
        rc = subprocess.run(cmd, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, timeout=900).returncode
    text = log.read_text(errors="replace")
    assert rc == 0, text[-4000:]
    summary = json.loads(text.strip().splitlines()[-1])
    first, last = summary["sft_loss_first_last"]
    assert last < first / 2, summary  # the SFT learnt the transcripts
    # every RL episode is multi-turn: the model called the tool, then answered (2 engine requests)
    assert all(t >= 1.5 for t in summary["rl_turns_per_sample"]) and len(summary["rl_turns_per_sample"]) == NUM_ROLLOUT
    run_dir = work / "rl"
    assert json.loads((run_dir / "FINISHED").read_text())["trained_rollouts"] == NUM_ROLLOUT

    probes = [json.loads(l) for l in (run_dir / "control" / "weight_probe.jsonl").read_text().splitlines()]
    assert {p["version"] for p in probes} >= set(range(1, NUM_ROLLOUT + 1)), probes
    assert all(p["match"] and len(p["engines"]) == 2 for p in probes), probes

    # each version read in place from the trainer's memfd buffers (CUDA IPC's CPU twin), none by the fallback
    assert_delivered_by(run_dir, "memfd", versions=set(range(1, NUM_ROLLOUT + 1)))
    metrics = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    phases = {m["rollout_id"] for m in metrics if {"time/engines_release", "time/onload", "time/publish"} <= set(m)}
    assert phases == set(range(NUM_ROLLOUT)), metrics[-1]

    logs = run_dir / "logs" / "attempt-0"
    trainer = "".join(p.read_text() for p in logs.glob("trainer-*.log"))
    assert trainer.count("copied in place to 2 engine(s)") >= NUM_ROLLOUT and " broadcast to " not in trainer
    engines = [p.read_text() for p in sorted(logs.glob("engine-*.log"))]
    assert len(engines) == 2 and all(e.count("read in place") >= NUM_ROLLOUT for e in engines)
    # the run's last checkpoint (no --save-interval reached it) is written outside the turn, where it onloads
    # the whole trainer: the engines gave their memory up first (on one H100 qwen3-4B died of an OOM in
    # that save beside the engines' weights and cache, bench/results/gpu-lease-2026-12-07f.md)
    rank0 = (logs / "trainer-0.log").read_text().splitlines()
    released = [i for i, l in enumerate(rank0) if "the engines give their memory up for a save outside the turn" in l]
    saved = [i for i, l in enumerate(rank0) if "saved checkpoint" in l]
    assert len(released) == 1 and saved and released[0] < saved[-1], [rank0[i] for i in released + saved]
    assert not [l for l in rank0 if "before the job's last save" in l]  # both engines answered the release
