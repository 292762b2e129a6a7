"""A truncated or bit-flipped file is detected by its checksum: the rollout is reported
corrupt (with the path), quarantined, never handed to the trainer, and regenerated."""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import pytest
from typer.testing import CliRunner

from rlslurm.buffer import CorruptRollout, Retention, RolloutReader, RolloutWriter, TrainerProgress, after_checkpoint
from rlslurm.buffer.cli import app
from rlslurm.buffer.manifest import _self_checksum
from rlslurm.errors import ConfigError

from .damage import (
    append_garbage,
    delete_data,
    flip_data_header,
    flip_data_middle,
    flip_manifest,
    tear_manifest,
    truncate,
)
from .helpers import assert_same, make_meta, make_samples


@pytest.mark.parametrize(
    "damage", [truncate, flip_data_middle, flip_data_header, append_garbage, delete_data, flip_manifest, tear_manifest]
)
def test_corrupt_rollout_quarantined_and_regenerated(run, damage, caplog):
    w = RolloutWriter(run)
    for rid in range(3):
        w.commit(rid, make_samples(rid), make_meta(rid))
    bad_path = damage(w, 1)
    r = RolloutReader(run)
    with pytest.raises(CorruptRollout, match=str(bad_path)):
        r.read(1)
    assert_same(r.read(0), make_samples(0))  # neighbours unaffected

    got = {}

    def trainer():
        got["rollout"] = r.wait_for(1, timeout=20, poll_interval=0.02)

    with caplog.at_level(logging.ERROR, logger="rlslurm.buffer.reader"):
        t = threading.Thread(target=trainer)
        t.start()
        deadline = time.monotonic() + 10

        def quarantine_done() -> bool:
            q = r.quarantined()
            return bool(q) and "manifest.json" in os.listdir(q[0]["path"]) and not any(
                n.startswith("00000001.") for n in os.listdir(w.dir)
            )

        while not quarantine_done() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "rollout" not in got  # never handed over while corrupt
        q = r.quarantined()
        assert [x["rollout_id"] for x in q] == [1] and str(bad_path) in q[0]["reason"]
        assert "manifest.json" in os.listdir(q[0]["path"])
        assert not r.is_committed(1)

        # the driver notices and regenerates it
        rp = RolloutWriter(run).resume_point()
        assert rp.to_regenerate == [1] and rp.next_rollout_id == 3
        w.commit(1, make_samples(1, seed=7), make_meta(1))
        t.join(10)
    assert_same(got["rollout"], make_samples(1, seed=7))
    assert any(str(bad_path) in rec.getMessage() for rec in caplog.records)
    assert RolloutWriter(run).resume_point().to_regenerate == []


def test_replay_reports_corruption_without_quarantine(run):
    w = RolloutWriter(run)
    w.commit(0, make_samples(0))
    p = flip_data_middle(w, 0)
    r = RolloutReader.replay(run)
    with pytest.raises(CorruptRollout, match=str(p)):
        r.wait_for(0, timeout=1)
    assert r.is_committed(0) and r.quarantined() == []


def test_cli_reports_corrupt_and_quarantined(run):
    w = RolloutWriter(run)
    for rid in range(3):
        w.commit(rid, make_samples(rid))
    p = truncate(w, 1)
    res = CliRunner().invoke(app, ["show", str(run.path), "1"])
    assert res.exit_code == 1 and str(p) in res.output and "corrupt" in res.output
    tear_manifest(w, 2)
    RolloutReader(run).quarantine(1, "test")
    res = CliRunner().invoke(app, ["ls", str(run.path), "--json"])
    rows = [json.loads(x) for x in res.stdout.splitlines()]
    assert rows[0]["rollout_id"] == 0 and rows[0]["samples"] == 8
    assert rows[1]["rollout_id"] == 2 and "corrupt" in rows[1]["error"]
    assert rows[2]["rollout_id"] == 1 and rows[2]["reason"] == "test"


def test_follower_ranks_wait_while_rank0_quarantines(run):
    w = RolloutWriter(run)
    w.commit(0, make_samples(0))
    flip_data_middle(w, 0)
    follower = RolloutReader(run, readonly=True)  # trainer rank != 0
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("r", follower.wait_for(0, timeout=20, poll_interval=0.02)))
    t.start()
    time.sleep(0.2)
    assert "r" not in got and t.is_alive()  # neither crashed nor handed the corrupt rollout over
    RolloutReader(run).quarantine(0, "rank 0 found it corrupt")
    w.commit(0, make_samples(0, seed=3))
    t.join(10)
    assert_same(got["r"], make_samples(0, seed=3))
    with pytest.raises(ConfigError):
        RolloutReader(run, readonly=True, on_corrupt="quarantine")


def test_quarantine_record_is_written_before_uncommitting(run, monkeypatch):
    """A reader that dies between writing the record and moving the manifest leaves the
    rollout committed; one that dies after leaves a record the driver acts on."""
    w = RolloutWriter(run)
    for rid in range(3):
        w.commit(rid, make_samples(rid), make_meta(rid))
    r = RolloutReader(run)
    import rlslurm.buffer.reader as reader_mod

    def die_after_rename(*a, **k):
        raise KeyboardInterrupt  # stands in for a crash right after the manifest moved

    monkeypatch.setattr(reader_mod, "fsync_dir", die_after_rename)
    with pytest.raises(KeyboardInterrupt):
        r.quarantine(1, "crash test")
    monkeypatch.undo()
    assert not r.is_committed(1)
    rp = RolloutWriter(run).resume_point()
    assert rp.to_regenerate == [1] and rp.next_rollout_id == 3


@pytest.mark.parametrize("name", ["../../../victim.txt", "<absolute path>", "00000000.abc.data/../../victim.txt",
                                  "00000001.abc.data", "00000000.abc.data\n", "00000000.ABC.data", "victim.txt", 7])
def test_manifest_data_name_is_a_buffer_file_or_the_rollout_is_corrupt(run, tmp_path, name):
    """A manifest is opened and its data file deleted by retention as buffer/train/<file>: a manifest
    whose checksum was recomputed after an edit (or a writer bug) must not point anywhere else."""
    victim = tmp_path / "victim.txt"
    victim.write_text("not the buffer's")
    w = RolloutWriter(run)
    for rid in range(3):
        w.commit(rid, make_samples(rid), make_meta(rid))
    p = w.manifest_path(0)
    body = json.loads(p.read_bytes())
    body.pop("manifest_checksum")
    body["data"]["file"] = str(victim) if name == "<absolute path>" else name
    body["manifest_checksum"] = _self_checksum(body)  # a consistent manifest, only the name is wrong
    p.write_text(json.dumps(body))

    r = RolloutReader(run)
    with pytest.raises(CorruptRollout, match=r"rollout 0 is corrupt: bad manifest: data file name"):
        r.manifest(0)
    progress = TrainerProgress()
    for rid in range(3):
        progress.record_trained(rid)
    assert after_checkpoint(r, progress, Retention(keep_trained=0)) == [0, 1]
    assert victim.read_text() == "not the buffer's"


def _checkpoint_mark(run, iteration: int, last_trained: int | None) -> None:
    """What trainer/checkpoint/ leaves for a complete checkpoint: `latest` and the completeness mark
    with its progress (only the fields the buffer reads; the tensors do not matter here)."""
    d = run.checkpoints_dir / f"iter_{iteration:07d}"
    d.mkdir(parents=True)
    (d / "rlslurm.json").write_text(json.dumps({"format": 1, "iteration": iteration, "files": {},
                                                "progress": {"last_trained_rollout_id": last_trained,
                                                             "next_rollout_id": iteration}}))
    (run.checkpoints_dir / "latest").write_text(json.dumps({"name": d.name, "iteration": iteration}))


@pytest.mark.parametrize("damage", [b'{"last_trained_rollout_id": 4, "next_ro', b"\x00\x00\x00", b"[4]"])
def test_a_damaged_trained_record_is_set_aside_and_rebuilt_from_the_checkpoint(run, damage, caplog):
    """buffer/trained.json is a hint written after each checkpoint. Damaged on disk it was a DataError (a
    user error: the job ended without requeue, on every resubmit) in the driver's resume_point and
    to_regenerate and the trainer's wait_for. Now it is set aside (kept for a post-mortem) with one
    warning, and the newest complete checkpoint's record stands in: the quarantined rollout trained
    since is not regenerated, the one not yet trained is; nothing is trained twice or lost."""
    w = RolloutWriter(run)
    for rid in range(6):
        w.commit(rid, make_samples(rid), make_meta(rid))
    r = RolloutReader(run)
    r.quarantine(2, "test: trained, then retired by its checkpoint")
    r.quarantine(5, "test: not trained yet")
    _checkpoint_mark(run, 5, 4)
    after_checkpoint(r, TrainerProgress(next_rollout_id=5, last_trained_rollout_id=4, trained_rollouts=5),
                     Retention(keep_trained=1))
    assert RolloutWriter(run).resume_point().to_regenerate == [5]
    run.buffer_dir.joinpath("trained.json").write_bytes(damage)
    with caplog.at_level(logging.WARNING, logger="rlslurm.buffer.atomic"):
        rp = RolloutWriter(run).resume_point()
    assert rp.to_regenerate == [5] and rp.next_rollout_id == 6
    warned = [rec.getMessage() for rec in caplog.records if "trained.json" in rec.getMessage()]
    assert len(warned) == 1 and "damaged on disk" in warned[0] and "set aside as .corrupt.trained.json." in warned[0]
    aside = [n for n in os.listdir(run.buffer_dir) if n.startswith(".corrupt.trained.json.")]
    assert len(aside) == 1 and (run.buffer_dir / aside[0]).read_bytes() == damage  # kept as it was
    # the trainer's wait: rollout 3 was retired after training, which the checkpoint's record still says
    with pytest.raises(ConfigError, match="already trained"):
        RolloutReader(run).wait_for(3, timeout=0)
    w.commit(5, make_samples(5), make_meta(5))
    assert_same(RolloutReader(run).wait_for(5, timeout=5, poll_interval=0.01), make_samples(5))
    # `buffer ls` (read-only) leaves a damaged record where it is
    run.buffer_dir.joinpath("trained.json").write_bytes(damage)
    assert RolloutReader(run, readonly=True).last_trained() == 4
    assert run.buffer_dir.joinpath("trained.json").read_bytes() == damage


def test_damaged_hand_back_and_quarantine_reason_are_never_final(run, caplog):
    """A hand-back or a quarantine's reason.json damaged on disk: set aside with a warning; the commit's
    cursor is used, and the quarantined rollout, known from its directory's name, is still regenerated."""
    w = RolloutWriter(run)
    for rid in range(3):
        w.commit(rid, make_samples(rid), make_meta(rid))
    w.save_handback({"epoch": 0, "position": 99})
    qdir = RolloutReader(run).quarantine(2, "test")
    (qdir / "reason.json").write_bytes(b'{"rollout_id": 2, "ki')
    w.handback_file.write_bytes(b"\xff\xfe")
    with caplog.at_level(logging.WARNING):
        rp = RolloutWriter(run).resume_point()
    assert rp.to_regenerate == [2] and not rp.from_handback
    assert rp.data_cursor == make_meta(2).data_cursor  # the newest commit's (quarantined) cursor
    assert sum("damaged on disk" in rec.getMessage() for rec in caplog.records) == 2
    assert [n for n in os.listdir(run.buffer_dir) if n.startswith(".corrupt.train-handback.json.")]


def test_a_manifest_name_holding_a_fifo_or_dev_zero_is_corrupt_not_a_hang(run):
    """What sits under a manifest's name is opened without blocking and checked before it is read: a
    FIFO (an open would wait forever) or a symlink to /dev/zero (read without end) is a corrupt rollout,
    named in one line, quarantined, then regenerated; the driver's resume reads past the quarantined
    FIFO too."""
    w = RolloutWriter(run)
    w.commit(0, make_samples(0), make_meta(0))
    os.mkfifo(w.dir / "00000001.manifest.json")
    os.symlink("/dev/zero", w.dir / "00000002.manifest.json")
    r = RolloutReader(run)
    with pytest.raises(CorruptRollout,
                       match=r"00000001.manifest.json: rollout 1 is corrupt: not a regular file \(a FIFO\)"):
        r.read(1)
    with pytest.raises(CorruptRollout, match=r"rollout 2 is corrupt: not a regular file \(a character device\)"):
        r.read(2)
    for rid in (1, 2):
        with pytest.raises(Exception, match="timeout|not committed"):  # quarantined, waits for the regeneration
            r.wait_for(rid, timeout=0.2, poll_interval=0.01)
    rp = RolloutWriter(run).resume_point()
    assert rp.to_regenerate == [1, 2] and rp.next_rollout_id == 3
    from rlslurm.buffer.atomic import read_bytes

    os.symlink("/dev/zero", run.control_dir / "engines.json")
    assert read_bytes(run.control_dir / "engines.json") == b""  # a record's reader: damaged, set aside
