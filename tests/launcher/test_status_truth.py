"""`rlslurm status` and `rlslurm run`'s own lines tell what the run's record says (issue 30, issue 33):
a run no scheduler knows of (a `rlslurm run`) gets its state from FINISHED, live heartbeats or the last
attempt's ledger line, not "UNKNOWN (from nowhere)"; engines are healthy only while the rollout group
lives; what each role does (its heartbeat's phase) and for how long; the transport of the published
version, and a disk fallback in yellow, not only as a log line."""

from __future__ import annotations

import io
import time
from pathlib import Path

from rich.console import Console

from rlslurm.attempt import LOCAL, Attempt, begin, end
from rlslurm.buffer.control import Control, EngineRecord
from rlslurm.buffer.rundir import RunDir
from rlslurm.local import Notices
from rlslurm.slurm.status import LIVE_S, phase_line, run_status, weights_line


def local_run(tmp_path: Path) -> tuple[RunDir, Control, Attempt]:
    rd = RunDir.create(tmp_path / "run")
    a = Attempt(0, LOCAL, int(time.time()), LOCAL, LOCAL)
    assert begin(rd, a) is None
    control = Control(rd)
    control.write_engines([EngineRecord(url="http://127.0.0.1:30000", node="n0", healthy=True)])
    return rd, control, a


def test_a_running_local_run_is_running_with_its_phases(tmp_path: Path) -> None:
    rd, control, _ = local_run(tmp_path)
    control.heartbeat("trainer", 0, phase="weight sync v3 (nccl): try 2/2", phase_since=time.time() - 250)
    control.heartbeat("rollout", 0, phase="rollout 3: waiting for its weights", phase_since=time.time() - 240)
    control.set_weight_version(2, transport="nccl", fallbacks=1,
                               last_fallback="v1: sending stage 0: [/w/gloo/pair.cc:553] Connection closed")
    st = run_status(rd.path, query_slurm=False)
    assert (st.slurm["state"], st.slurm["source"], st.live) == ("RUNNING", "run directory", True)
    assert st.engines[0]["healthy"] and not st.engines[0].get("gone")
    trainer = next(p for p in st.phases if p["role"] == "trainer")
    assert trainer["phase"] == "weight sync v3 (nccl): try 2/2" and 249 < trainer["for_s"] < 260
    assert phase_line(trainer, st.live).endswith("try 2/2 for 250 s")
    line = weights_line(st.weights)
    assert line.plain.startswith("v2 via nccl  1 version(s) delivered by the disk fallback this attempt"), line.plain
    assert "yellow" in str(line.spans[0].style)
    assert "[/w/gloo/pair.cc:553]" in line.plain  # gloo's bracketed source location is not read as markup
    Console(file=io.StringIO()).print(line)  # and prints


def test_a_finished_or_ended_local_run_says_so_and_its_engines_are_gone(tmp_path: Path) -> None:
    rd, control, a = local_run(tmp_path)
    control.heartbeat("rollout", 0, phase="generating rollout 5", phase_since=time.time() - 3)
    end(rd, a, 1, "failed: the rollout ended first (rc=1)")
    st = run_status(rd.path, query_slurm=False)
    assert st.slurm["state"] == "ENDED (failed: the rollout ended first (rc=1))" and not st.live
    assert st.engines[0]["gone"] and not st.engines[0]["healthy"]
    rd.mark_finished({"trained_rollouts": 6})
    assert run_status(rd.path, query_slurm=False).slurm["state"] == "FINISHED"
    # a heartbeat long silent: its process is gone, whatever engines.json last said
    old = {"role": "rollout", "rank": 0, "phase": "generating rollout 5", "for_s": 900.0, "age_s": LIVE_S + 1}
    assert "its last heartbeat" in phase_line(old, live=True)


def test_rlslurm_run_prints_a_fallback_and_a_stall(tmp_path: Path, monkeypatch) -> None:
    rd, control, _ = local_run(tmp_path)
    buf = io.StringIO()
    notices = Notices(rd, Console(file=buf, width=300), time.time() - 1000)
    monkeypatch.setattr(Notices, "STALL_S", 5.0)
    control.heartbeat("trainer", 0, phase="weight sync v1 (nccl): try 1/2", phase_since=time.time() - 300)
    notices.check()
    assert "no rollout trained for" in buf.getvalue() and "weight sync v1 (nccl): try 1/2 for 300 s" in buf.getvalue()
    control.set_weight_version(1, transport="disk", fallbacks=1, last_fallback="v1: joining engines: timed out")
    notices.check()
    assert "weight sync fell back to disk" in buf.getvalue() and "v1: joining engines: timed out" in buf.getvalue()
    n = buf.getvalue().count("fell back")
    notices.check()
    assert buf.getvalue().count("fell back") == n  # once per fallback


def test_a_requeued_job_pending_without_reason_gets_the_command_that_starts_it() -> None:
    """Issue 33: a requeued het job can sit PENDING (None) for minutes on a quiet cluster
    (docs/slurm-test-cluster.md); `rlslurm status` says so and what starts it now."""
    from rlslurm.slurm.status import pending_hint

    slurm = {"state": "PENDING", "reason": "None", "restarts": 1,
             "components": [{"id": "41", "offset": "0"}, {"id": "42", "offset": "1"}]}
    assert "scontrol update jobid=41 StartTime=now" in pending_hint(slurm)
    assert pending_hint({**slurm, "restarts": 0}) is None  # a fresh job waiting for nodes: nothing to say
    assert pending_hint({**slurm, "reason": "Resources"}) is None


def test_status_changes_nothing_in_a_run_with_damaged_records(tmp_path: Path) -> None:
    """`rlslurm status` is a look: damaged control records, trained.json and FINISHED (the filesystem's
    doing) are read as absent and stay where they are; the run's own processes set them aside."""
    import os

    rd, control, _ = local_run(tmp_path)
    control.heartbeat("trainer", 0, phase="training rollout 3")
    damaged = {rd.control_dir / "engines.json": b'{"engines": [{"url"', rd.control_dir / "weight_version.json": b"\0\0",
               rd.control_dir / "heartbeats" / "trainer-0.json": b"{", rd.buffer_dir / "trained.json": b"[3]",
               rd.finished: b"\xff"}
    for path, data in damaged.items():
        path.write_bytes(data)
    before = {d: sorted(os.listdir(d)) for d in (rd.control_dir, rd.control_dir / "heartbeats", rd.buffer_dir, rd.path)}
    st = run_status(rd.path, query_slurm=False)
    assert st.engines == [] and st.weights is None and st.last_trained_rollout is None and st.finished
    assert {d: sorted(os.listdir(d)) for d in before} == before  # nothing renamed
    assert all(path.read_bytes() == data for path, data in damaged.items())
