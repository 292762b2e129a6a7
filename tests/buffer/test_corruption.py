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

from .damage import (append_garbage, delete_data, flip_data_header, flip_data_middle, flip_manifest, tear_manifest,
                     truncate)
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
