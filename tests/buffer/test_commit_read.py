from __future__ import annotations

import os
import threading
import time

import pytest

from rlslurm.buffer import (
    AlreadyCommitted,
    BufferTimeout,
    Cancelled,
    ReadOnlyBuffer,
    Retention,
    RolloutMeta,
    RolloutReader,
    RolloutWriter,
    TrainerProgress,
    after_checkpoint,
)
from rlslurm.errors import ConfigError, DataError

from .helpers import assert_same, make_meta, make_samples


def test_commit_is_immutable(run):
    w = RolloutWriter(run)
    w.commit(0, make_samples(0), make_meta(0))
    with pytest.raises(AlreadyCommitted, match="00000000.manifest.json"):
        w.commit(0, make_samples(0, seed=1))
    assert_same(RolloutReader(run).read(0), make_samples(0))
    assert len([n for n in os.listdir(w.dir) if n.endswith(".data")]) == 1


def test_refuses_empty_negative_and_wrong_kind(run):
    w = RolloutWriter(run)
    with pytest.raises(DataError, match="at least one sample"):
        w.commit(0, [])
    with pytest.raises(DataError, match=">= 0"):
        w.commit(-1, make_samples(0))
    with pytest.raises(DataError, match="meta.kind is 'eval'"):
        w.commit(0, make_samples(0), RolloutMeta(kind="eval"))


def test_writer_needs_a_run_dir(tmp_path):
    with pytest.raises(ConfigError, match=str(tmp_path / "nope")):
        RolloutWriter(tmp_path / "nope")


def test_resume_point_follows_commits(run):
    w = RolloutWriter(run)
    assert w.resume_point().next_rollout_id == 0 and w.resume_point().data_cursor == {}
    for rid in range(3):
        w.commit(rid, make_samples(rid), make_meta(rid))
    rp = RolloutWriter(run).resume_point()  # a restarted driver
    assert rp.next_rollout_id == 3 and rp.data_cursor == {"epoch": 0, "offset": 6} and rp.to_regenerate == []


def test_eval_and_train_are_separate(run):
    RolloutWriter(run).commit(0, make_samples(0))
    RolloutWriter(run, kind="eval").commit(0, make_samples(100), RolloutMeta(kind="eval"))
    assert_same(RolloutReader(run, kind="eval").read(0), make_samples(100))
    assert_same(RolloutReader(run).read(0), make_samples(0))
    with pytest.raises(ValueError, match="kind"):
        RolloutReader(run, kind="test")


def test_wait_for_timeout_and_cancel(run):
    r = RolloutReader(run)
    t0 = time.monotonic()
    with pytest.raises(BufferTimeout, match="rollout 5 was not committed within 0.3 s"):
        r.wait_for(5, timeout=0.3, poll_interval=0.05)
    assert 0.3 <= time.monotonic() - t0 < 5  # the timeout is kept; the upper bound only says it did not hang
    ev = threading.Event()
    threading.Timer(0.2, ev.set).start()
    t0 = time.monotonic()
    with pytest.raises(Cancelled):
        r.wait_for(5, timeout=30, poll_interval=10, cancel=ev)  # the event wakes the sleep
    assert time.monotonic() - t0 < 5  # well before the 10 s poll interval
    calls = []
    with pytest.raises(Cancelled):
        r.wait_for(5, poll_interval=0.01, cancel=lambda: calls.append(1) or len(calls) > 3)
    with pytest.raises(ConfigError, match="poll interval"):
        r.wait_for(5, poll_interval=0)


def test_wait_for_in_thread_sees_commit(run):
    r = RolloutReader(run)
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("r", r.wait_for(1, timeout=10, poll_interval=0.02)))
    t.start()
    time.sleep(0.1)
    RolloutWriter(run).commit(0, make_samples(0))
    time.sleep(0.1)
    assert "r" not in got  # rollout 0 is not rollout 1
    RolloutWriter(run).commit(1, make_samples(1))
    t.join(5)
    assert_same(got["r"], make_samples(1))


def test_cleanup_removes_only_orphans(run):
    w = RolloutWriter(run)
    w.commit(0, make_samples(0))
    (w.dir / "00000001.deadbeef.data").write_bytes(b"half a rollout")
    (w.dir / ".tmp.00000002.abc.data.1.x").write_bytes(b"")
    assert w.cleanup(min_age_s=3600) == []  # too young: could be a live writer's
    removed = {p.name for p in w.cleanup(min_age_s=0)}
    assert removed == {"00000001.deadbeef.data", ".tmp.00000002.abc.data.1.x"}
    assert_same(RolloutReader(run).read(0), make_samples(0))


def test_replay_is_read_only(run, tmp_path):
    w = RolloutWriter(run)
    for rid in range(2):
        w.commit(rid, make_samples(rid))
    r = RolloutReader.replay(run.path)
    assert_same(r.wait_for(1, timeout=1), make_samples(1))
    with pytest.raises(ReadOnlyBuffer):
        r.quarantine(0, "x")
    p = TrainerProgress()
    p.record_trained(0)
    with pytest.raises(ReadOnlyBuffer):
        after_checkpoint(r, p)
    from rlslurm.buffer import RunDir

    empty = RunDir.create(tmp_path / "empty")
    with pytest.raises(ConfigError, match="no committed train rollouts"):
        RolloutReader.replay(empty)


def test_progress_refuses_out_of_order_and_roundtrips():
    p = TrainerProgress()
    p.record_trained(0)
    with pytest.raises(DataError, match="expected rollout 1"):
        p.record_trained(2)
    p.record_trained(1, weight_version=9)
    q = TrainerProgress.from_state_dict(p.state_dict())
    assert q == p and q.next_rollout_id == 2 and q.weight_version == 9
    with pytest.raises(ConfigError):
        TrainerProgress.from_state_dict({"version": 99})


def test_retention_keeps_last_k_trained_and_all_untrained(run, tmp_path):
    w, r = RolloutWriter(run), RolloutReader(run)
    for rid in range(8):
        w.commit(rid, make_samples(rid))
    p = TrainerProgress()
    for rid in range(6):
        p.record_trained(r.wait_for(rid, timeout=1))
    retired = after_checkpoint(r, p, Retention(keep_trained=2, export_dir=tmp_path / "export"))
    assert retired == [0, 1, 2, 3]
    assert r.committed_ids() == [4, 5, 6, 7]
    assert r.last_trained() == 5
    assert sorted(os.listdir(tmp_path / "export")) == [f"train-{i:08d}.jsonl" for i in range(4)]
    data_files = [n for n in os.listdir(r.dir) if n.endswith(".data")]
    assert len(data_files) == 4
    # everything trained, keep 0: the newest stays (it holds the driver's data cursor)
    for rid in range(6, 8):
        p.record_trained(r.wait_for(rid, timeout=1))
    after_checkpoint(r, p, Retention(keep_trained=0))
    assert r.committed_ids() == [7]
    assert RolloutWriter(run).resume_point().next_rollout_id == 8
    with pytest.raises(ConfigError):
        Retention(keep_trained=-1)


def test_retention_keeps_from_the_oldest_kept_checkpoint_and_at_least_keep_trained(run):
    w, r = RolloutWriter(run), RolloutReader(run)
    for rid in range(10):
        w.commit(rid, make_samples(rid))
    p = TrainerProgress()
    for rid in range(8):
        p.record_trained(r.read(rid))
    # a kept checkpoint resumes at rollout 3: 3..7 would be trained again after a fallback to it
    assert after_checkpoint(r, p, Retention(keep_trained=2, keep_from=3)) == [0, 1, 2]
    # keep_trained reaching further back than the oldest checkpoint wins
    assert after_checkpoint(r, p, Retention(keep_trained=5, keep_from=6)) == []
    assert after_checkpoint(r, p, Retention(keep_trained=4, keep_from=6)) == [3]
    assert r.committed_ids() == list(range(4, 10))
    with pytest.raises(ConfigError, match="keep_from"):
        Retention(keep_from=-1)


def test_waiting_for_a_retired_rollout_is_an_error_not_a_hang(run):
    w, r = RolloutWriter(run), RolloutReader(run)
    for rid in range(4):
        w.commit(rid, make_samples(rid))
    p = TrainerProgress()
    for rid in range(4):
        p.record_trained(r.read(rid))
    after_checkpoint(r, p, Retention(keep_trained=1))
    with pytest.raises(ConfigError, match="rollout 1 was already trained"):
        r.wait_for(1, timeout=5)
    assert_same(r.wait_for(3, timeout=1), make_samples(3))


def test_resume_point_survives_quarantine_of_the_newest_and_retention(run):
    w, r = RolloutWriter(run), RolloutReader(run)
    for rid in range(4):
        w.commit(rid, make_samples(rid), make_meta(rid))
    p = TrainerProgress()
    for rid in range(3):
        p.record_trained(r.read(rid))
    after_checkpoint(r, p, Retention(keep_trained=0))
    assert r.committed_ids() == [3]
    r.quarantine(3, "corrupt")  # the only committed rollout goes away
    rp = RolloutWriter(run).resume_point()
    assert rp.next_rollout_id == 4 and rp.to_regenerate == [3]
    assert rp.data_cursor == make_meta(3).data_cursor  # not back to the start of the data
    # a regenerated rollout committed later carries the newest cursor, even with a lower id
    w.commit(4, make_samples(4), make_meta(4))
    w.commit(3, make_samples(3, seed=1), RolloutMeta(data_cursor={"epoch": 0, "offset": 99}))
    rp = RolloutWriter(run).resume_point()
    assert rp.next_rollout_id == 5 and rp.to_regenerate == [] and rp.data_cursor == {"epoch": 0, "offset": 99}


def test_regenerated_then_retired_is_not_regenerated_again(run):
    w, r = RolloutWriter(run), RolloutReader(run)
    for rid in range(3):
        w.commit(rid, make_samples(rid))
    r.quarantine(1, "corrupt")
    assert w.to_regenerate() == [1]
    w.commit(1, make_samples(1, seed=2))
    assert w.to_regenerate() == []
    p = TrainerProgress()
    for rid in range(3):
        p.record_trained(r.read(rid))
    after_checkpoint(r, p, Retention(keep_trained=0))
    assert r.committed_ids() == [2]
    assert w.to_regenerate() == [] and w.resume_point().next_rollout_id == 3


@pytest.mark.parametrize(
    "meta, match",
    [
        (RolloutMeta(metrics={"gen_s": float("nan")}), "metric 'gen_s' must be a finite number"),
        (RolloutMeta(data_cursor={"pos": object()}), "JSON-serialisable"),
        (RolloutMeta(weight_versions=[1.5]), "weight_versions must be integers"),
    ],
)
def test_bad_meta_is_named_and_nothing_is_written(run, meta, match):
    w = RolloutWriter(run)
    with pytest.raises(DataError, match=f"rollout 0 meta: .*{match}"):
        w.commit(0, make_samples(0), meta)
    assert os.listdir(w.dir) == []


def test_retention_survives_a_corrupt_trained_rollout(run, tmp_path):
    w, r = RolloutWriter(run), RolloutReader(run)
    for rid in range(3):
        w.commit(rid, make_samples(rid))
    p = TrainerProgress()
    for rid in range(3):
        p.record_trained(r.read(rid))
    (w.dir / w.manifest(0).data_file).write_bytes(b"rotted")
    w.manifest_path(1).write_text("{")
    assert after_checkpoint(r, p, Retention(keep_trained=0, export_dir=tmp_path / "x")) == [0, 1]
    assert r.committed_ids() == [2]
    assert os.listdir(tmp_path / "x") == []
