"""Watching a run (issue 46): `rlslurm status` of a run no attempt of which lives tells how it ended,
not what its processes last did, and counts trained rollouts, not the buffer's (retention retires
them); `--json` says the same; `rlslurm status --follow` prints a line per trained step until the run's
attempt ends; `rlslurm run`'s live table ends its line before the summary that follows it."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from rlslurm.attempt import LOCAL, Attempt, begin, end
from rlslurm.buffer import RolloutWriter
from rlslurm.buffer.control import Control
from rlslurm.buffer.progress import Retention, TrainerProgress, after_checkpoint
from rlslurm.buffer.reader import RolloutReader
from rlslurm.buffer.rundir import RunDir
from rlslurm.local import end_live
from rlslurm.settings.config import RunConfig
from rlslurm.settings.runfile import dump_run_config
from rlslurm.slurm.status import run_status
from rlslurm.step_line import step_line
from rlslurm.watch import follow
from tests.buffer.helpers import make_meta, make_samples

ROOT = Path(__file__).resolve().parents[2]
# Real step records (a THD run on an H100, bench/results/thd-run-h100.md): two steps per rollout.
RECORDS = [json.loads(l) for l in (ROOT / "bench/results/thd-run-h100/thd-bf16-metrics.jsonl").read_text().splitlines()]


def trained_run(tmp_path: Path, rollouts: int = 6, keep: int = 2) -> tuple[RunDir, Attempt]:
    """A `rlslurm run`'s directory after `rollouts` rollouts, generated, trained (metrics.jsonl),
    checkpointed and retired from the buffer down to the last `keep` trained, its attempt still open
    and both roles' heartbeats saying what they were doing."""
    rd = RunDir.create(tmp_path / "run")
    cfg = RunConfig.model_validate({"run": {"run_dir": str(rd.path)}, "rollout": {"num_rollout": 10}})
    (rd.path / "run.yaml").write_text(dump_run_config(cfg))
    a = Attempt(0, LOCAL, int(time.time()), LOCAL, LOCAL)
    assert begin(rd, a) is None
    writer, progress = RolloutWriter(rd), TrainerProgress()
    for rid in range(rollouts):
        writer.commit(rid, make_samples(rid), make_meta(rid))
        progress.record_trained(rid)
    after_checkpoint(RolloutReader(rd), progress, Retention(keep_trained=keep))
    rd.metrics.write_text("".join(json.dumps(r) + "\n" for r in RECORDS[: 2 * rollouts]))
    control = Control(rd)
    control.heartbeat("trainer", 0, phase=f"waiting for the checkpoint of {rollouts} rollouts to be written",
                      phase_since=time.time() - 5)
    control.heartbeat("rollout", 0, phase=f"generating rollout {rollouts - 1}", phase_since=time.time() - 5)
    return rd, a


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rlslurm", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)


def test_a_finished_run_tells_its_end_not_its_last_phases(tmp_path: Path) -> None:
    rd, a = trained_run(tmp_path)
    rd.mark_finished({"trained_rollouts": 6})
    end(rd, a, 0, "finished")
    text = cli("status", str(rd.path)).stdout
    rows = dict(l.split("\t", 1) for l in text.split("\n\n")[0].splitlines())
    assert rows["finished"].startswith("yes (attempt 0, ") and rows["finished"].endswith(", exit 0)")
    assert rows["rollouts"] == "6/10 trained (6 in the last checkpoint), 6 generated (2 kept in the buffer)"
    assert "trainer 0" not in rows and "rollout 0" not in rows and "waiting for the checkpoint" not in text
    st = json.loads(cli("status", str(rd.path), "--json").stdout)
    assert st["phases"] == [] and not st["attempt_lives"]
    assert (st["rollouts_trained"], st["rollouts_generated"], st["rollouts_committed"],
            st["num_rollout"]) == (6, 6, 2, 10)
    assert (st["ended"]["attempt"], st["ended"]["reason"], st["ended"]["exit_code"]) == (0, "finished", 0)


def test_an_interrupted_run_says_how_it_ended(tmp_path: Path) -> None:
    rd, a = trained_run(tmp_path)
    reason = "interrupted (Ctrl-C); the trainer checkpointed (iteration 6): run the same command again to continue"
    end(rd, a, 130, reason)
    st = run_status(rd.path, query_slurm=False)
    assert st.slurm["state"] == f"ENDED ({reason})" and st.phases == [] and st.ended["exit_code"] == 130
    text = cli("status", str(rd.path)).stdout
    assert f"ended\t{reason} (attempt 0, " in text and "generating rollout 5" not in text


def test_a_running_run_shows_its_phases(tmp_path: Path) -> None:
    rd, _ = trained_run(tmp_path)
    st = run_status(rd.path, query_slurm=False)
    assert st.attempt_lives and st.ended is None and {p["role"] for p in st.phases} == {"trainer", "rollout"}
    text = cli("status", str(rd.path)).stdout
    assert "running\tattempt 0 since " in text and "rollout 0\tgenerating rollout 5 for " in text


def test_follow_prints_each_step_until_the_attempt_ends(tmp_path: Path) -> None:
    rd, a = trained_run(tmp_path, rollouts=3)
    buf = io.StringIO()

    def train_two_more_and_end() -> None:
        time.sleep(0.5)
        with open(rd.metrics, "a") as f:
            f.write(json.dumps(RECORDS[6]) + "\n")
            f.write(json.dumps(RECORDS[7]) + "\n")
        time.sleep(0.5)
        end(rd, a, 1, "failed: the rollout ended first (rc=1)")

    t = threading.Thread(target=train_two_more_and_end)
    t.start()
    try:
        st = follow(rd.path, Console(file=buf, width=1000), recent=2, poll_s=0.1, status_every_s=0.2,
                    query_slurm=False)
    finally:
        t.join()
    lines = buf.getvalue().splitlines()
    assert lines[:4] == [step_line(r) for r in RECORDS[4:8]]  # the last 2 before, the 2 trained while it followed
    assert lines[4].startswith("ended: failed: the rollout ended first (rc=1) (attempt 0, ") and len(lines) == 5
    assert not st.attempt_lives


def test_status_follow_of_an_ended_run_prints_its_last_steps_and_returns(tmp_path: Path) -> None:
    rd, a = trained_run(tmp_path)
    rd.mark_finished({"trained_rollouts": 6})
    end(rd, a, 0, "finished")
    p = cli("status", str(rd.path), "--follow")
    assert p.returncode == 0, p.stderr
    tail = p.stdout.splitlines()[-6:]
    assert tail[:5] == [step_line(r) for r in RECORDS[7:12]] and tail[5].startswith("finished: yes (attempt 0, ")
    assert "give one of them" in cli("status", str(rd.path), "--follow", "--json").stderr


def test_the_live_table_ends_its_line_before_what_follows() -> None:
    buf = io.StringIO()
    console = Console(file=buf, width=100)  # into a file, as `rlslurm run > log` or a batch log
    t = Table(show_header=False, box=None)
    t.add_row("ended", "finished")
    live = Live(t, console=console, refresh_per_second=1, transient=False)
    live.start()
    end_live(live)
    console.print("reward per rollout: ...")
    assert "\nreward per rollout: ..." in buf.getvalue()


def test_the_demo_model_is_written_without_a_progress_bar(tmp_path: Path, capfd) -> None:
    """`rlslurm run --demo` began its output with transformers' "Writing model shards" bar (one shard);
    the bar is off only while the tiny checkpoint is written."""
    from transformers.utils import logging as hf_logging

    from rlslurm.settings.model_config import load_model_config
    from rlslurm.tiny import make_tiny_checkpoint

    make_tiny_checkpoint(load_model_config("tiny-qwen3"), tmp_path / "hf")
    out, err = capfd.readouterr()
    assert "Writing model shards" not in out + err and (tmp_path / "hf" / "model.safetensors").exists()
    assert hf_logging.is_progress_bar_enabled()
