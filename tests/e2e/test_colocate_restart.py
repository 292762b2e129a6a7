"""--colocate under a fault (issue 31 item 5): an engine killed with SIGKILL while the trainer holds the
GPUs (its turn: the engines released, the trainer training) is restarted only after the turn, never
inside it, where on a GPU the new engine would take the memory the trainer uses (the engine or the
trainer OOMs). `rlslurm run --demo --colocate` on the CPU stack: real megatron-core trainer, real
SGLang engines taking turns with it, weights by memfd.

The kill lands when trainer rank 0's heartbeat says "training rollout N" (after the release and the
onload). When the restart began comes from the rollout process's own log ("...; restarting"), the
turn's end from the trainer's ("weights vN+1 ... to k engine(s)" is the turn's publish, "the turn of
vN+1 is over" its end). Before the fix the supervisor restarted the engine within a health interval
of the kill and the turn waited for it, publishing only after it was back."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.megatron, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
NUM_ROLLOUT = 4
KILL_IN = 1  # the rollout whose turn the kill lands in


def _t(line: str) -> float:
    """The asctime at the start of a role's log line, as epoch seconds."""
    m = re.search(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})", line)
    assert m, line
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _lines(path: Path, pattern: str) -> list[str]:
    return [l for l in path.read_text(errors="replace").splitlines() if re.search(pattern, l)] if path.exists() else []


def _phase(run: Path) -> str:
    try:
        return json.loads((run / "control" / "heartbeats" / "trainer-0.json").read_text()).get("phase") or ""
    except (OSError, ValueError):
        return ""  # not there yet, or replaced under our read


def test_engine_killed_in_the_trainers_turn_restarts_after_it(tmp_path: Path) -> None:
    run, log = tmp_path / "run", tmp_path / "run.log"
    cmd = [sys.executable, "-m", "rlslurm.cli", "run", "--demo", "--colocate", "--run-dir", str(run), "--no-progress",
           "--num-rollout", str(NUM_ROLLOUT), "--save-interval", "1000", "--engine-health-interval-s", "1",
           # a turn of many small steps (~8 s on the CPU stack): the supervisor, checking every second,
           # notices the kill well inside it, however loaded the machine (4 steps, ~2 s, were not enough)
           "--num-steps-per-rollout", "16", "--global-batch-size", "2", "--micro-batch-size", "1",
           "--verify-weight-sync"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 900
        while not _phase(run).startswith(f"training rollout {KILL_IN}"):
            assert proc.poll() is None, log.read_text(errors="replace")[-4000:]
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-4000:]
            time.sleep(0.02)
        victim = json.loads((run / "control" / "engines.json").read_text())["engines"][0]
        os.kill(victim["pid"], signal.SIGKILL)
        killed_at = time.time()
        rc = proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 0, log.read_text(errors="replace")[-4000:]
    assert json.loads((run / "FINISHED").read_text())["trained_rollouts"] == NUM_ROLLOUT
    logs = run / "logs" / "attempt-0"
    version = KILL_IN + 1  # what the turn of rollout KILL_IN publishes
    url = re.escape(victim["url"])
    restarts = _lines(logs / "rollout-0.log", rf"\({url}\): exited \(code -9\); restarting")
    assert len(restarts) == 1, _lines(logs / "rollout-0.log", url)
    restart_at = _t(restarts[0])
    assert restart_at >= killed_at - 1
    trainer = logs / "trainer-0.log"
    published = _lines(trainer, rf"weights v{version} .* to \d+ engine")
    assert published, _lines(trainer, "weights v")
    # the turn's publish came first (before the fix the turn waited for the restarted engine to publish)
    assert restart_at > _t(published[0]), (restarts[0], published[0])
    over = _lines(trainer, rf"the turn of v{version} is over")
    assert over and restart_at >= _t(over[0]), (restarts[0], over)
    # the restart said why it waited, and the engine came back: the run went on and every probe matched
    assert _lines(logs / "rollout-0.log", rf"its restart waits: the trainer's turn for v{version}")
    engines = json.loads((run / "control" / "engines.json").read_text())["engines"]
    assert [e["restarts"] for e in engines if e["url"] == victim["url"]] == [1], engines
    probes = [json.loads(l) for l in (run / "control" / "weight_probe.jsonl").read_text().splitlines()]
    assert probes and all(p["match"] for p in probes), probes
