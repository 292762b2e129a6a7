"""What the GPU tier's tests read from a run (its own records and the processes it started), shared by
test_gpu_grpo.py, test_layouts.py and test_submit_slurm.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from rlslurm.buffer.control import Control
from rlslurm.buffer.rundir import RunDir


def metrics(run_dir: Path) -> list[dict]:
    p = run_dir / "metrics.jsonl"
    return [json.loads(l) for l in p.read_text().splitlines()] if p.exists() else []


def logprob_diffs(ms: list[dict]) -> list[float]:
    """|train - rollout logprob| of each trained rollout that recorded it (metrics.jsonl)."""
    return [m["train_rollout_logprob_abs_diff"] for m in ms if "train_rollout_logprob_abs_diff" in m]


def probes(run_dir: Path) -> list[dict]:
    p = run_dir / "control" / "weight_probe.jsonl"
    return [json.loads(l) for l in p.read_text().splitlines()] if p.exists() else []


def tail(p: Path, n: int = 3000) -> str:
    return p.read_text(errors="replace")[-n:] if p.exists() else ""


def logs(run_dir: Path, log: Path) -> str:
    parts = [f"== {log.name}\n{tail(log)}"]
    for f in sorted(run_dir.glob("logs/attempt-*/*.log")):
        parts.append(f"== {f.relative_to(run_dir)}\n{tail(f, 2000)}")
    return "\n".join(parts)


def finish(proc: subprocess.Popen, run_dir: Path, log: Path, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"rlslurm run did not end within {timeout:.0f} s\n{logs(run_dir, log)}")


def gpu_processes() -> dict[int, str]:
    """pid -> GPU UUID of every process nvidia-smi sees on a GPU."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return {int(p): u.strip().lower() for p, u in (l.split(",") for l in out.splitlines() if l.strip())}


def ancestors(pid: int) -> list[int]:
    chain = []
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            break
        chain.append(pid)
    return chain


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def who_is_on_which_gpu(run_dir: Path) -> dict[str, set[str]]:
    """{"trainer": GPUs, "engines": GPUs} from nvidia-smi: a process is the trainer's if it runs
    rlslurm.trainer.main, an engine's if an engine server of engines.json is it or its ancestor."""
    engine_pids = {e.pid for e in Control(RunDir(run_dir)).engines() if e.pid}
    out: dict[str, set[str]] = {"trainer": set(), "engines": set(), "other": set()}
    for pid, gpu in gpu_processes().items():
        if "rlslurm.trainer.main" in cmdline(pid):
            out["trainer"].add(gpu)
        elif pid in engine_pids or engine_pids & set(ancestors(pid)):
            out["engines"].add(gpu)
        else:
            out["other"].add(gpu)
    return out
