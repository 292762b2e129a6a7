"""ENOSPC while committing gives a clear error and leaves the committed state intact.
Uses a 1 MiB tmpfs (tests/helpers/small_fs.py, root); skipped only outside CI."""

from __future__ import annotations

import os

import pytest

from rlslurm.buffer import (
    Retention,
    RolloutReader,
    RolloutWriter,
    RunDir,
    StorageError,
    TrainerProgress,
    after_checkpoint,
)

from .helpers import assert_same, make_meta, make_samples


def _debris(d):
    return [n for n in os.listdir(d) if n.startswith(".tmp.")]


def test_enospc_is_clear_and_keeps_committed_state(small_fs):
    run = RunDir.create(small_fs / "run")
    w, r = RolloutWriter(run), RolloutReader(run)
    committed = []
    with pytest.raises(StorageError) as ei:
        for rid in range(100):
            w.commit(rid, make_samples(rid, n=8, response_len=4096), make_meta(rid))
            committed.append(rid)
    failed = len(committed)
    assert "no space left on device" in str(ei.value)
    assert str(w.dir) in str(ei.value)  # names the file it could not write
    assert failed >= 2
    assert r.committed_ids() == committed
    for rid in committed:
        assert_same(r.read(rid), make_samples(rid, n=8, response_len=4096))
    assert _debris(w.dir) == []
    assert len([n for n in os.listdir(w.dir) if n.endswith(".data")]) == len(committed)  # failed data removed
    assert w.resume_point().next_rollout_id == failed

    # once space is freed (training + retention), the same id commits cleanly
    p = TrainerProgress()
    for rid in committed:
        p.record_trained(r.read(rid))
    after_checkpoint(r, p, Retention(keep_trained=0))
    w.commit(failed, make_samples(failed, n=8, response_len=4096), make_meta(failed))
    assert_same(r.read(failed), make_samples(failed, n=8, response_len=4096))


def test_enospc_on_the_manifest_itself(small_fs):
    """Data fits, the manifest does not: nothing is committed, the data file is removed."""
    run = RunDir.create(small_fs / "run")
    w, r = RolloutWriter(run), RolloutReader(run)
    w.commit(0, make_samples(0), make_meta(0))
    samples = make_samples(1, n=4, response_len=1500)
    from rlslurm.buffer.codec import encode

    page = os.statvfs(small_fs).f_frsize
    data_pages = -(-encode(samples).size // page)
    st = os.statvfs(small_fs)
    free = st.f_bavail * st.f_frsize
    filler = small_fs / "filler"
    filler.write_bytes(b"\0" * (free - data_pages * page))
    st = os.statvfs(small_fs)
    assert st.f_bavail == data_pages  # exactly room for the data file, none for the manifest
    with pytest.raises(StorageError, match="manifest.json: no space left on device"):
        w.commit(1, samples, make_meta(1))
    assert r.committed_ids() == [0] and _debris(w.dir) == []
    assert [n for n in os.listdir(w.dir) if n.startswith("00000001")] == []
    assert_same(r.read(0), make_samples(0))
    filler.unlink()
    w.commit(1, samples, make_meta(1))
    assert_same(r.read(1), samples)
