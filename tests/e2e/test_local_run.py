"""The README's demo path, `rlslurm run --demo` (local mode: trainer under torchrun + the rollout
process tree with real SGLang servers and router, no SLURM), stopped by Ctrl-C midway (what a user at
a terminal does; `rlslurm stop` is the same request, tested on the SLURM cluster) and continued by
running the same command again.

What a stop must guarantee: the trainer saves what it trained before exiting (here
--save-interval is larger than the run, so only the stop's own checkpoint can carry the progress
over), the rollout group keeps its engines until the trainer acknowledges, and running the command
again clears the stop and continues right after the last trained rollout: every rollout id is
trained exactly once over the two attempts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlslurm.buffer.control import Control
from rlslurm.curve import reward_curve
from tests.helpers.deliveries import assert_delivered_by
from tests.helpers.process_groups import rollout_pids

pytestmark = [pytest.mark.sglang, pytest.mark.megatron, pytest.mark.slow]

NUM_ROLLOUT = 6
ROOT = Path(__file__).resolve().parents[2]


def rlslurm_run(run_dir: Path, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rlslurm.cli", "run", "--demo", "--run-dir", str(run_dir), "--no-progress",
           "--num-rollout", str(NUM_ROLLOUT), "--save-interval", "1000", "--rollout-batch-size", "8"]
    # As a terminal's foreground job gets it: a suite started in the background (`cmd &` in a script,
    # nohup) passes SIGINT on ignored, and Python then never raises KeyboardInterrupt for it.
    return subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def trained_ids(run_dir: Path) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    p = run_dir / "metrics.jsonl"
    for line in (p.read_text().splitlines() if p.exists() else []):
        rec = json.loads(line)
        ids = out.setdefault(rec["attempt"], [])
        if not ids or ids[-1] != rec["rollout_id"]:
            ids.append(rec["rollout_id"])
    return out


def finish(proc: subprocess.Popen, log: Path, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"rlslurm run did not end within {timeout:.0f} s:\n{log.read_text()[-4000:]}")


def test_demo_stops_cleanly_and_continues(tmp_path: Path) -> None:
    run_dir, log = tmp_path / "demo", tmp_path / "run.log"
    proc = rlslurm_run(run_dir, log)
    deadline = time.monotonic() + 900
    while sum(len(v) for v in trained_ids(run_dir).values()) < 2:
        assert proc.poll() is None, f"rlslurm run ended early (rc={proc.returncode}):\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(1)
    # The rollout process is held (SIGSTOP) until the stop is requested, so the run cannot finish
    # meanwhile however slowly this test is scheduled: the trainer trains only what is committed.
    [rollout] = rollout_pids(run_dir)
    group = os.getpgid(rollout)
    assert group != os.getpgid(0)  # its own session (rlslurm/local.py), never this test's
    os.killpg(group, signal.SIGSTOP)
    try:
        # Ctrl-C reaches only `rlslurm run` (its children have their own sessions). It must not signal
        # them before the trainer's checkpoint is done: a TERM to the trainer's process group during the
        # save also reached megatron's checkpoint-writer helper process, the save failed and every
        # trained rollout was trained again (found by tools/gpu/field-check.sh).
        proc.send_signal(signal.SIGINT)
        while Control(run_dir).stop_requested() is None:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
    finally:
        os.killpg(group, signal.SIGCONT)
    assert finish(proc, log, 400) == 130, log.read_text()[-4000:]
    assert "the trainer checkpointed" in log.read_text()

    control = run_dir / "control"
    ack = json.loads((control / "stop_ack.json").read_text())
    first = trained_ids(run_dir)[0]
    assert first == list(range(len(first))) and len(first) < NUM_ROLLOUT
    # the stop's checkpoint holds every trained rollout (the save interval alone would have saved none)
    assert ack["checkpoint_iteration"] == len(first)
    assert not (run_dir / "FINISHED").exists()

    proc = rlslurm_run(run_dir, log)  # the same command again: clears the stop, resumes
    assert finish(proc, log, 900) == 0, log.read_text()[-4000:]
    assert f"{run_dir}: cleared the earlier stop request\n" in log.read_text()  # one line, whatever the width
    ids = trained_ids(run_dir)
    assert sorted(ids) == [0, 1] and ids[1][0] == first[-1] + 1, ids
    assert ids[0] + ids[1] == list(range(NUM_ROLLOUT))
    assert json.loads((run_dir / "FINISHED").read_text())["trained_rollouts"] == NUM_ROLLOUT
    assert [r for r, _ in reward_curve(run_dir)] == list(range(NUM_ROLLOUT))
    assert (run_dir / "reward_curve.png").exists()
    # every version went over the gloo broadcast group, the resumed attempt's first one included
    recs = assert_delivered_by(run_dir, "gloo")
    assert {d["attempt"] for d in recs} == {0, 1} and all(d["tries"] == 1 for d in recs), recs
    # the finished local run as `rlslurm status` tells it: from the run's own record, engines gone
    st = json.loads(subprocess.run([sys.executable, "-m", "rlslurm.cli", "status", str(run_dir), "--json"], cwd=ROOT,
                                   capture_output=True, text=True, check=True, timeout=120).stdout)
    assert (st["slurm"]["state"], st["slurm"]["source"], st["live"]) == ("FINISHED", "run directory", False), \
        st["slurm"]
    assert st["engines"] and all(e["gone"] and not e["healthy"] for e in st["engines"]), st["engines"]
    assert (st["weights"]["version"], st["weights"]["transport"],
            st["weights"]["fallbacks"]) == (NUM_ROLLOUT, "gloo", 0)
    # ... its end, not what its processes last did; trained rollouts counted, not those the buffer keeps
    assert st["phases"] == [] and (st["ended"]["attempt"], st["ended"]["reason"]) == (1, "finished"), st
    assert (st["rollouts_trained"], st["num_rollout"]) == (NUM_ROLLOUT, NUM_ROLLOUT), st
    # a line per step in the trainer's log and in `rlslurm run`'s output, each attempt's own steps
    # (rlslurm/step_line.py: the same formatter over the records of metrics.jsonl)
    from rlslurm.step_line import step_line

    recs = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    out = log.read_text()
    for n in (0, 1):
        lines = [step_line(r) for r in recs if r["attempt"] == n]
        assert lines and all(f" INFO {l}\n" in (run_dir / f"logs/attempt-{n}/trainer-0.log").read_text() for l in lines)
        assert all(f"{l}\n" in out for l in lines), out[-3000:]
    first = [step_line(r) for r in recs if r["attempt"] == 0]
    assert all(" | tok/s gen " in l and l.endswith(f" | weights v{r + 1} gloo")
               for r, l in enumerate(first[::2])), first
    # logs are the owner's only, as under SLURM's umask 077, and no file but control/api_key holds the key
    key = (control / "api_key").read_bytes().strip()
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert [p for p in files if key in p.read_bytes()] == [control / "api_key"]
    logs = [p for p in (run_dir / "logs").rglob("*") if p.suffix == ".log"]
    assert len(logs) >= 8 and all(oct(p.stat().st_mode & 0o777) == "0o600" for p in logs), logs
