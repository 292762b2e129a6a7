from __future__ import annotations

import json
import os
import time

import pytest

from rlslurm.attempt import clear_stale
from rlslurm.buffer import Control, EngineRecord, RendezvousRecord, RendezvousTaken, read_ledger
from rlslurm.buffer.atomic import CorruptRecord
from rlslurm.buffer.ledger import LedgerProblem


def test_engines_router_weight_version(run):
    c = Control(run)
    assert c.engines() == [] and c.router() is None and c.weight_version() is None
    c.write_engines([EngineRecord(url="http://n1:30000", node="n1", gpu_ids=[0, 1], pid=42, healthy=True)])
    c.write_router("http://n1:30010")
    c.set_weight_version(7)
    assert c.engines()[0].gpu_ids == [0, 1] and c.engines()[0].healthy
    assert c.router().url == "http://n1:30010"
    assert c.weight_version().version == 7


def test_bad_record_names_file_and_is_set_aside(run):
    """The run writes every control record itself, atomically: one that reads as damaged was damaged
    on disk. Not a user error (that would end the run for good): it is set aside, the attempt fails
    (requeued), and the next attempt's writer rebuilds it (tests/buffer/test_transient.py has more)."""
    from rlslurm.buffer.atomic import CorruptRecord
    from rlslurm.errors import UserError

    c = Control(run)
    (run.control_dir / "router.json").write_text(json.dumps({"uri": "x"}))
    with pytest.raises(CorruptRecord, match="router.json") as ei:
        c.router()
    assert not isinstance(ei.value, UserError)
    assert c.router() is None  # set aside: the next writer starts afresh
    assert [n for n in os.listdir(run.control_dir) if n.startswith(".corrupt.router.json.")]


def test_rendezvous_once_per_attempt(run):
    c = Control(run)
    rec = RendezvousRecord(master_addr="n0", master_port=29600, world_size=3, group_name="ws-0", attempt=0)
    c.publish_rendezvous(rec)
    with pytest.raises(RendezvousTaken, match="rendezvous-0.json"):
        c.publish_rendezvous(rec.model_copy(update={"master_port": 29601}))
    assert c.rendezvous(0).master_port == 29600
    assert c.rendezvous(1) is None
    c.publish_rendezvous(rec.model_copy(update={"attempt": 1, "master_port": 29700, "group_name": "ws-1"}))
    assert c.wait_for_rendezvous(1, timeout=1).master_port == 29700
    with pytest.raises(TimeoutError, match="rendezvous-2"):
        c.wait_for_rendezvous(2, timeout=0.2, poll_interval=0.05)


def test_heartbeats(run):
    c = Control(run)
    c.heartbeat("trainer", 0)
    c.heartbeat("driver", 0)
    hbs = c.heartbeats()
    assert {(h.role, h.rank) for h in hbs} == {("trainer", 0), ("driver", 0)}
    assert all(h.pid == os.getpid() for h in hbs)
    assert c.stale_heartbeats(max_age_s=3600) == []
    assert len(c.stale_heartbeats(max_age_s=-1)) == 2


def test_preempt_ack_stop_and_new_attempt(run):
    """An attempt's start (rlslurm/attempt.py) clears the preempt request and ack; a stop stays."""
    c = Control(run)
    assert c.preempt_requested() is None and c.stop_requested() is None
    # written by the batch script (tmp + mv), shape fixed by the lead
    req = {"reason": "USR1", "requested_at": 1.5, "job_id": "12", "restart_count": 0}
    (run.control_dir / "preempt.tmp").write_text(json.dumps(req))
    os.rename(run.control_dir / "preempt.tmp", run.control_dir / "preempt.json")
    assert c.preempt_requested() == req
    c.ack_preempt(checkpoint_iteration=40)
    assert json.loads((run.control_dir / "preempt_ack.json").read_text())["checkpoint_iteration"] == 40
    c.request_stop("user asked")
    clear_stale(run)
    assert c.preempt_requested() is None and c.preempt_ack() is None
    assert c.stop_requested().reason == "user asked"  # a stop outlives the attempt


def test_ledger_skips_and_reports_torn_lines(run):
    assert read_ledger(run) == []
    lines = [
        json.dumps({"job_id": "1", "restart_count": 0, "start": 1.0, "end": 2.0, "reason": "preempt"}),
        '{"job_id": "1", "restart_co',  # torn by a crash mid-append
        "[1, 2]",
        "",
        json.dumps({"job_id": "1", "restart_count": 1, "start": 3.0}),
    ]
    run.ledger.write_text("\n".join(lines))  # last line has no newline: still read
    problems: list[LedgerProblem] = []
    got = read_ledger(run, problems)
    assert [r["restart_count"] for r in got] == [0, 1]
    assert [p.where for p in problems] == [f"{run.ledger}:2", f"{run.ledger}:3"]


def test_a_ledger_line_with_a_wrongly_typed_field_is_skipped_with_one_line(run, tmp_path):
    """`rlslurm status` sorted the attempts by their number and compared checkpoints: one hand-edited line
    ({"attempt": "zero"}) was a TypeError traceback. Such a line is skipped, named by path:line."""
    from rlslurm.slurm.status import run_status

    run.ledger.write_text("\n".join([
        json.dumps({"attempt": 0, "job_id": "1", "start": 1, "end": 2, "exit_code": 1, "reason": "failed: x",
                    "checkpoint": 2}),
        json.dumps({"attempt": "zero", "job_id": "1", "start": 1, "end": 2, "exit_code": 1, "reason": "failed: y"}),
        json.dumps({"attempt": 2, "reason": ["x"], "end": 3}),
        json.dumps({"attempt": 3, "checkpoint": True, "reason": "failed"}),
        json.dumps({"event": "resubmitted", "next_attempt": "4", "reset_failures": 1}),
    ]) + "\n")
    problems: list[LedgerProblem] = []
    assert [r["attempt"] for r in read_ledger(run, problems)] == [0]
    assert [(p.where, p.message) for p in problems] == [
        (f"{run.ledger}:2", "field 'attempt' is \"zero\", not int; skipped"),
        (f"{run.ledger}:3", "field 'reason' is [\"x\"], not str; skipped"),
        (f"{run.ledger}:4", "field 'checkpoint' is true, not int; skipped"),
        (f"{run.ledger}:5", "field 'next_attempt' is \"4\", not int; skipped")]
    st = run_status(run.path, query_slurm=False)
    assert [a["attempt"] for a in st.attempts] == [0] and st.slurm["state"].startswith("ENDED")


def test_stop_ack_and_clear(run):
    c = Control(run)
    assert c.clear_stop() is False and c.stop_ack() is None
    c.request_stop("user asked")
    c.ack_stop(checkpoint_iteration=7)
    assert c.stop_ack().checkpoint_iteration == 7
    clear_stale(run)
    assert c.stop_requested() is not None and c.stop_ack() is not None  # both outlive an attempt
    assert c.clear_stop() is True  # `rlslurm resubmit` / `rlslurm run` continuing the run
    assert c.stop_requested() is None and c.stop_ack() is None


def test_weight_update_bracket(run):
    c = Control(run)
    assert c.weight_update() is None
    t0 = time.time()
    c.mark_weight_update(4, budget_s=60)
    # the on-disk format engines/update_watch.py has always read
    raw = json.loads(c.weight_update_file.read_text())
    assert set(raw) == {"state", "version", "until", "pid"} and raw["state"] == "updating"
    rec = c.weight_update()
    assert (rec.version, rec.pid) == (4, os.getpid()) and t0 + 60 <= rec.until <= time.time() + 60
    c.clear_weight_update()
    assert c.weight_update() is None and not c.weight_update_file.exists()
    c.clear_weight_update()  # idempotent: the failure path clears it again


@pytest.mark.parametrize("body", ['{"state": "updating", "until": "soon"}',
                                  '{"state": "done", "version": 1, "until": 1, "pid": 2}', "not json"])
def test_corrupt_weight_update_is_one_line_naming_the_file(run, body):
    c = Control(run)
    run.control_dir.mkdir(parents=True, exist_ok=True)
    c.weight_update_file.write_text(body)
    with pytest.raises(CorruptRecord, match="weight_update.json") as e:
        c.weight_update()
    assert "\n" not in str(e.value)
