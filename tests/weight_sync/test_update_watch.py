"""The rollout node's `UpdateWatcher` against a real `EngineSupervisor` (its engines are never
started: only the pause bracket is exercised, no SGLang needed): it holds the health checks
while control/weight_update.json is active, lets go when the trainer removes it, and never
longer than its cap for one record — a hung sync must not disable health checks for good."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from rlslurm.buffer.atomic import unlink_durable, write_json_atomic
from rlslurm.buffer.control import Control
from rlslurm.buffer.rundir import RunDir
from rlslurm.engines.engine import EngineSpec
from rlslurm.engines.router import RouterProcess
from rlslurm.engines.supervisor import EngineSupervisor
from rlslurm.engines.update_watch import UpdateWatcher, active_update, update_in_progress
from rlslurm.net import engine_port_block, free_port


@pytest.fixture
def setup(tmp_path: Path):
    run = RunDir.create(tmp_path / "run")
    control = Control(run)
    specs = [EngineSpec(name=f"engine-{i}", model_path=str(tmp_path), host="127.0.0.1", port=p.port,
                        nccl_port=p.nccl_port, log_path=tmp_path / f"engine-{i}.log", device="cpu")
             for i, p in enumerate(engine_port_block("127.0.0.1", 2))]
    router = RouterProcess(host="127.0.0.1", port=free_port(), log_path=tmp_path / "router.log")
    return control, EngineSupervisor(specs, router)


def _mark(control: Control, version: int, until_s: float, pid: int | None = None) -> None:
    # written raw: the on-disk format of the record the weight publishers write (trainer/weights/tries.py)
    # (Control.mark_weight_update), so that a format change shows here
    write_json_atomic(control.weight_update_file, {"state": "updating", "version": version,
                                                  "until": time.time() + until_s, "pid": pid or os.getpid()})


def _wait(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_holds_while_active_and_releases_when_removed(setup):
    control, sup = setup
    w = UpdateWatcher(control, sup, cap_s=30.0, poll_s=0.01).start()
    try:
        time.sleep(0.1)
        assert not sup.paused
        _mark(control, 3, 60)
        assert _wait(lambda: sup.paused), "the watcher did not pause the health checks"
        time.sleep(0.2)
        assert sup.paused and w.held == 1
        unlink_durable(control.weight_update_file)
        assert _wait(lambda: not sup.paused), "the watcher did not resume the health checks"
        assert w.held == 1 and w.capped == 0
    finally:
        w.close()
    assert not sup.paused


def test_hung_sync_holds_at_most_the_cap_then_a_new_try_is_honoured(setup, caplog):
    control, sup = setup
    cap = 0.5
    w = UpdateWatcher(control, sup, cap_s=cap, poll_s=0.01).start()
    try:
        with caplog.at_level(logging.WARNING, logger="rlslurm.engines.update_watch"):
            _mark(control, 4, 3600)  # a trainer that hangs: its record says "updating" for an hour
            assert _wait(lambda: sup.paused)
            t0 = time.monotonic()
            assert _wait(lambda: not sup.paused, cap + 5), "health checks stayed paused past the cap"
            held_s = time.monotonic() - t0
        assert cap - 0.05 <= held_s <= cap + 1.0, held_s
        assert w.capped == 1
        assert any("still marked in progress" in r.message and "resuming engine health checks" in r.message
                   for r in caplog.records), caplog.text
        time.sleep(3 * cap)  # the same record is not held again
        assert not sup.paused and w.held == 1
        _mark(control, 4, 3600, pid=os.getpid() + 1)  # the trainer's next try rewrites it
        assert _wait(lambda: sup.paused), "a new record was not honoured"
        assert w.held == 2
    finally:
        w.close()
    assert not sup.paused


def test_stale_or_foreign_records_do_not_pause(setup):
    control, sup = setup
    _mark(control, 5, -1)  # a crashed trainer's record, past its `until`
    assert active_update(control) is None and not update_in_progress(control)
    (control.weight_update_file).write_text("not json")  # torn/foreign: ignored, not fatal
    assert active_update(control) is None
    write_json_atomic(control.weight_update_file, {"state": "updating", "until": "soon"})
    assert active_update(control) is None
    w = UpdateWatcher(control, sup, cap_s=30.0, poll_s=0.01).start()
    try:
        time.sleep(0.3)
        assert not sup.paused and w.held == 0
    finally:
        w.close()
    with pytest.raises(ValueError, match="cap_s"):
        UpdateWatcher(control, sup, cap_s=0)


def test_a_restart_in_progress_does_not_delay_the_hold(setup):
    """Entering the pause must not wait for an engine being restarted (~60 s on CPU): that
    engine is not in the update, and the other engines are blocked in it now."""
    control, sup = setup
    with sup._cond:
        sup._slots[1].restarting = True  # what EngineSupervisor._tick sets while a restart runs
    w = UpdateWatcher(control, sup, cap_s=30.0, poll_s=0.01).start()
    try:
        _mark(control, 6, 60)
        assert _wait(lambda: sup.paused and w.held == 1, 2.0), "the hold waited for the restart"
        unlink_durable(control.weight_update_file)
        assert _wait(lambda: not sup.paused, 2.0)
    finally:
        w.close()
        with sup._cond:
            sup._slots[1].restarting = False


def test_covers_answers_from_a_fresh_read_between_the_watchers_polls(setup):
    """The watcher looks every 10 s (each look costs the shared filesystem ~4 metadata operations per
    rollout node, docs/shared-fs-load.md); a health check that fails in between asks `covers()`, which
    reads the record itself, within the record's cap, and the watcher holds what it found."""
    control, sup = setup
    w = UpdateWatcher(control, sup, cap_s=0.5, poll_s=60.0).start()
    try:
        assert not w.covers()
        _mark(control, 4, 60)
        assert w.covers()  # the watcher has not looked yet; the answer is fresh
        assert _wait(lambda: sup.paused), "what covers() found was not held"
        assert _wait(lambda: not sup.paused, 2.0), "held past the cap"  # the hold ends at the cap, not the poll
        assert not w.covers()  # past the cap on this node's clock: a hung sync excuses nothing
        _mark(control, 5, 60)  # the trainer's next try: a new record, honoured afresh
        assert w.covers()
        unlink_durable(control.weight_update_file)
        assert not w.covers()
    finally:
        w.close()


def test_a_node_that_does_not_look_reads_the_record_only_when_a_check_fails(setup, monkeypatch):
    """Nodes > 0 (`look=False`): no read of control/weight_update.json between updates; the first
    failed health check of an update (`covers`) starts the hold, which then lasts until the record
    goes, as a hold the watcher found itself (docs/shared-fs-load.md)."""
    control, sup = setup
    reads = []
    real = Control.weight_update
    monkeypatch.setattr(Control, "weight_update", lambda self: reads.append(1) or real(self))
    w = UpdateWatcher(control, sup, cap_s=30.0, poll_s=0.02, look=False).start()
    try:
        _mark(control, 7, 60)
        time.sleep(0.3)
        assert not sup.paused and reads == [], "the watcher looked on its own"
        assert w.covers()  # what the supervisor asks when a check fails
        assert _wait(lambda: sup.paused), "a failed check's update was not held"
        assert w.held == 1
        unlink_durable(control.weight_update_file)
        assert _wait(lambda: not sup.paused), "the hold outlived the update"
        n = len(reads)
        time.sleep(0.3)
        assert len(reads) == n and not sup.paused, "reads went on after the update"
    finally:
        w.close()
