"""--colocate under faults (issue 31 item 5), one scenario for the CPU stack (tests/e2e/
test_colocate_restart.py) and for GPUs (tests/gpu/test_colocate_faults.py): `rlslurm run --demo
--colocate`, real megatron-core trainer and real SGLang engines taking turns with it.

1. An engine killed with SIGKILL while the trainer holds the GPUs (its turn: the engines released, the
   trainer training) is restarted only after the turn, never inside it, where on a GPU the new engine
   would take the memory the trainer uses (the engine or the trainer OOMs). Before the fix the
   supervisor restarted the engine within a health interval of the kill and the turn waited for it.
2. A TERM inside a later turn (`rlslurm run` turns it into a stop): the checkpoint is written inside the
   turn, with the engines still released, and acknowledged; the trainer does not resume the engines
   first and then onload everything beside them to save (docs/colocate.md, "When the job ends inside a
   turn").

The kill and the TERM land when trainer rank 0's heartbeat says "training rollout N" (after the release
and the onload). After the kill the trainer's processes are stopped (SIGSTOP) until the rollout node has
seen the engine gone: how soon the supervisor notices depends on the CPU it gets (seconds on a loaded
two-core machine), and the scenario is a death seen inside the turn, so the turn must not end first.
When the restart began comes from the rollout process's own log ("...; restarting"), the turn's end from
the trainer's ("weights vN+1 ... to k engine(s)" is the turn's publish, "the turn of vN+1 is over" its
end)."""

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

ROOT = Path(__file__).resolve().parents[2]
NUM_ROLLOUT = 4
KILL_IN = 1  # the rollout whose turn the kill lands in
TERM_IN = 2  # the rollout whose turn the TERM lands in


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


def _trainer_processes(root: int) -> list:
    """The trainer's processes under `rlslurm run` (torchrun and its ranks), as psutil processes."""
    import psutil

    out = [p for p in psutil.Process(root).children(recursive=True)
           if any("rlslurm.trainer" in a or "torch.distributed.run" in a or "rlslurm.slurm.torchrun" in a
                  for a in p.cmdline())]
    assert out, "no trainer process under rlslurm run"
    return out


def _wait_phase(run: Path, proc: subprocess.Popen, log: Path, prefix: str, deadline: float) -> None:
    while not _phase(run).startswith(prefix):
        assert proc.poll() is None, log.read_text(errors="replace")[-4000:]
        assert time.monotonic() < deadline, log.read_text(errors="replace")[-4000:]
        time.sleep(0.02)


def kill_then_term_inside_turns(tmp_path: Path, extra: list[str], *, steps: int, engines: int,
                                timeout_s: float = 900) -> Path:
    """The scenario of the module docstring; `extra`: the stack's flags (device, engine flags); `steps`:
    optimizer steps per rollout, enough that a turn outlasts the supervisor noticing the kill (every
    second, but seconds late on a loaded two-core machine: 16 steps, a 3.5 s turn there, were not
    enough); `engines`: how many the run has (with one, the turn's publish has no engine to go to).
    Returns the run directory for the caller's own checks."""
    run, log = tmp_path / "run", tmp_path / "run.log"
    cmd = [sys.executable, "-m", "rlslurm.cli", "run", "--demo", "--colocate", "--run-dir", str(run), "--no-progress",
           "--num-rollout", str(NUM_ROLLOUT), "--save-interval", "1000", "--engine-health-interval-s", "1",
           # a turn of many small steps: the supervisor notices the kill well inside it
           "--num-steps-per-rollout", str(steps), "--global-batch-size", "2", "--micro-batch-size", "1",
           "--rollout-batch-size", str(steps // 2), "--n-samples-per-prompt", "4",  # the batch identity
           "--verify-weight-sync",
           # the scenario is about the trainer's moves (a save inside the turn onloads nothing, one outside
           # it onloads everything): ask for them, the default keeps what fits (nothing moves on CPU)
           "--offload-train", *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        _wait_phase(run, proc, log, f"training rollout {KILL_IN}", deadline)
        victim = json.loads((run / "control" / "engines.json").read_text())["engines"][0]
        trainers = _trainer_processes(proc.pid)
        for p in trainers:  # the turn holds until the node has seen the death (module docstring)
            p.send_signal(signal.SIGSTOP)
        try:
            os.kill(victim["pid"], signal.SIGKILL)
            killed_at = time.time()
            seen = rf"\({re.escape(victim['url'])}\): exited \(code -9\)"
            while not _lines(run / "logs" / "attempt-0" / "rollout-0.log", seen):
                assert time.monotonic() < deadline, log.read_text(errors="replace")[-4000:]
                time.sleep(0.1)
        finally:
            for p in trainers:
                p.send_signal(signal.SIGCONT)
        _wait_phase(run, proc, log, f"training rollout {TERM_IN}", deadline)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = log.read_text(errors="replace")
    logs = run / "logs" / "attempt-0"
    trainer = logs / "trainer-0.log"

    # 1. the kill: the restart waited for the turn's end
    assert rc == 143, out[-4000:]  # interrupted by the TERM, after the checkpoint below
    version = KILL_IN + 1  # what the turn of rollout KILL_IN publishes
    url = re.escape(victim["url"])
    restarts = _lines(logs / "rollout-0.log", rf"\({url}\): exited \(code -9\); restarting")
    assert len(restarts) == 1, _lines(logs / "rollout-0.log", url)
    restart_at = _t(restarts[0])
    assert restart_at >= killed_at - 1
    published = _lines(trainer, rf"weights v{version} .* to \d+ engine")
    assert published, _lines(trainer, "weights v")
    over = _lines(trainer, rf"the turn of v{version} is over")
    assert over and restart_at >= _t(over[0]), (restarts[0], over)
    if engines > 1:
        # the turn published to the engines still up, first (before the fix the turn waited for the
        # restarted engine to publish)
        assert restart_at > _t(published[0]), (restarts[0], published[0])
    else:  # no engine inside the turn: the version goes out to the restarted one once it is back
        assert _lines(trainer, rf"weight version {version} reached no engine"), _lines(trainer, "weight")
        assert _t(published[0]) >= restart_at, (restarts[0], published[0])
    # the restart said why it waited, and the engine came back: the run went on and every probe matched
    assert _lines(logs / "rollout-0.log", rf"its restart waits: the trainer's turn for v{version}")
    engines = json.loads((run / "control" / "engines.json").read_text())["engines"]
    assert [e["restarts"] for e in engines if e["url"] == victim["url"]] == [1], engines
    probes = [json.loads(l) for l in (run / "control" / "weight_probe.jsonl").read_text().splitlines()]
    assert probes and all(p["match"] for p in probes), probes

    # 2. the TERM: saved inside the turn of TERM_IN, the engines never resumed for it, then acknowledged
    trained = TERM_IN + 1
    ended = _lines(trainer, r"\[trainer 0\].*the job ends inside the turn: saved before the engines resume")
    saved = _lines(trainer, rf"\[trainer 0\].*saved checkpoint .*iter_{trained:07d}")
    over = _lines(trainer, rf"the turn of v{trained} is over")
    assert ended and saved and over, _lines(trainer, "turn|saved")
    assert _t(saved[0]) <= _t(ended[0]) <= _t(over[0])  # the save, then the turn ends without a resume
    assert not _lines(trainer, rf"weights v{trained} ")  # no publish of what the interrupted turn trained
    ack = json.loads((run / "control" / "stop_ack.json").read_text())
    assert ack["checkpoint_iteration"] == trained, ack
    assert json.loads((run / "checkpoints" / "latest").read_text())["iteration"] == trained
    assert not (run / "FINISHED").exists()
    assert f"the trainer checkpointed (iteration {trained})" in out, out[-2000:]
    return run
