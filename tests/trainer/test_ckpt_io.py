"""Checkpoints under the shared filesystem's transient errors (docs/checkpoints.md, "When the filesystem
fails"): a rank's forked write is repeated from its staged copy, the completeness mark and the verify
reads are retried, a checkpoint that cannot be read at resume or that verifies but does not load is
passed over for the previous complete one with one warning. Each errno is injected into the calls the
code makes; megatron's writer is stood in for by a function that writes a file and reports the way
megatron's does (its workers' OSErrors come back as results)."""

from __future__ import annotations

import errno
import json
import multiprocessing as mp
import os
import pickle
from pathlib import Path

import pytest
import torch.distributed as dist
from conftest import commit_rollouts  # noqa: F401  (at import time, like the other trainer test files)

from rlslurm.buffer import atomic
from rlslurm.buffer.progress import TrainerProgress
from rlslurm.trainer import checkpoint as ck
from rlslurm.trainer.checkpoint import resuming, writer
from rlslurm.trainer.collectives import group_timeout


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch):
    monkeypatch.setattr(atomic, "RETRY_DELAYS_S", (0.01, 0.01, 0.01))


def _flaky_write(failures: int, counter: Path, shard: Path):
    """megatron's `write_preloaded_data_multiproc` stand-in: each call writes the shard afresh and puts its
    results (or, the first `failures` calls, the EIO a worker met) on the queue."""
    def write(_transforms, buckets, q):
        n = int(counter.read_text() or 0) + 1 if counter.exists() else 1
        counter.write_text(str(n))
        with open(shard, "wb") as f:
            f.write(b"x" * (10 if n <= failures else 100))
        q.put(OSError(errno.EIO, "Input/output error") if n <= failures else {0: [f"result of try {n}"]})
    return write


@pytest.mark.parametrize("failures,ok", [(2, True), (10, False)])
def test_a_ranks_write_is_repeated_from_its_staged_copy(tmp_path: Path, failures: int, ok: bool) -> None:
    """EIO from megatron's write (a worker's, handed back as its result): the forked writer writes this
    rank's files again from the same staged copy, within the bounds of every other transient error;
    past them it reports a TransientStorageError (the attempt fails, requeued), not a traceback."""
    counter, shard, results = tmp_path / "tries", tmp_path / "__0_0.distcp", tmp_path / ".rlslurm-write-0.pkl"
    fd = os.memfd_create("area")
    os.ftruncate(fd, 4096)
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    writer._JOB = (_flaky_write(failures, counter, shard), (None, []), results, 1, send, (fd, 4096))
    writer._JOB_PARENT = os.getpid()
    try:
        p = ctx.Process(target=writer._child)
        p.start()
    finally:
        writer._JOB = None
        send.close()
    status, error = recv.recv()
    p.join(30)
    if ok:
        assert (status, error) == ("ok", None) and int(counter.read_text()) == failures + 1
        assert shard.stat().st_size == 100 and pickle.loads(results.read_bytes()) == [f"result of try {failures + 1}"]
    else:
        assert status == "error" and isinstance(error, atomic.TransientStorageError), error
        assert "writing the checkpoint files of rank 0" in str(error) and not results.exists()
        assert int(counter.read_text()) == len(atomic.RETRY_DELAYS_S) + 1


def _fake_ckpt(root: Path, it: int) -> Path:
    d = root / ck.ckpt_name(it)
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(bytes(range(256)) * (it + 1))
    (d / "common.pt").write_bytes(b"common" * it)
    ck.write_meta(d, it, 1, {"progress": {"last_trained_rollout_id": it - 1}})
    (root / ck.LATEST).write_text(json.dumps({"name": d.name, "iteration": it}))
    return d


class FlakyOpen:
    """`open` whose first `times` opens of paths containing `match` raise `err`."""

    def __init__(self, err: int, times: int, match: str):
        self.err, self.left, self.match, self.raised = err, times, match, 0
        self.real = open

    def __call__(self, path, *a, **kw):
        if self.left and self.match in str(path):
            self.left -= 1
            self.raised += 1
            raise OSError(self.err, os.strerror(self.err))
        return self.real(path, *a, **kw)


@pytest.mark.parametrize("err", [errno.EIO, errno.ESTALE])
def test_the_completeness_mark_and_the_verify_reads_are_retried(tmp_path: Path, monkeypatch, err: int) -> None:
    d = tmp_path / ck.ckpt_name(2)
    d.mkdir()
    (d / "__0_0.distcp").write_bytes(b"a" * 1000)
    flaky = FlakyOpen(err, 2, "__0_0.distcp")
    monkeypatch.setattr("builtins.open", flaky)
    ck.write_meta(d, 2, 1, {})  # fsync + crc32 of each file
    assert flaky.raised == 2 and (d / ck.META).exists()
    flaky.left = 2
    assert ck.verify(d) is None and flaky.raised == 4


def test_a_checkpoint_unreadable_at_resume_is_passed_over(tmp_path: Path, monkeypatch, capsys) -> None:
    """EIO that outlasts the retries while verifying the newest checkpoint at resume: it is unusable, one
    warning, and the previous complete one is resumed (it used to crash rank 0)."""
    d2, d4 = _fake_ckpt(tmp_path, 2), _fake_ckpt(tmp_path, 4)
    monkeypatch.setattr("builtins.open", FlakyOpen(errno.EIO, 10**6, str(d4 / "__0_0.distcp")))
    assert ck.find_resume(tmp_path) == d2
    err = capsys.readouterr().err
    assert f"checkpoint {d4} is unusable: {d4} cannot be read: " in err and "falling back" in err


@pytest.fixture
def gloo_world(tmp_path: Path):
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1,
                            timeout=group_timeout(2))
    yield
    dist.destroy_process_group()


def test_a_checkpoint_that_verifies_but_does_not_load_is_passed_over(tmp_path: Path, monkeypatch, capsys,
                                                                     gloo_world) -> None:
    """`resume`: the newest checkpoint verifies (its files match their sizes; big files are not
    checksummed) but megatron cannot load it: one warning and the previous complete one is loaded. When
    none loads the attempt fails, never a silent start from scratch over trained progress."""
    root = tmp_path / "checkpoints"
    d2, d4 = _fake_ckpt(root, 2), _fake_ckpt(root, 4)
    loaded = []

    def load(st, d):
        loaded.append(d.name)
        if d == d4:
            raise RuntimeError("CheckpointingException: unexpected key in the state dict")
        return TrainerProgress(next_rollout_id=2, trained_rollouts=2, last_trained_rollout_id=1)

    monkeypatch.setattr(resuming, "load", load)
    progress, d = ck.resume(None, root)
    assert d == d2 and progress.next_rollout_id == 2 and loaded == [d4.name, d2.name]
    err = capsys.readouterr().err
    assert f"checkpoint {d4} verifies but does not load (rank 0: RuntimeError: CheckpointingException" in err
    monkeypatch.setattr(resuming, "load", lambda st, d: (_ for _ in ()).throw(OSError(errno.EIO, "Input/output error")))
    with pytest.raises(RuntimeError, match=r"no checkpoint loads \(iter_0000004: .*iter_0000002: .*requeued"):
        ck.resume(None, root)


def test_the_hf_export_retries_its_writes(tmp_path: Path, monkeypatch) -> None:
    """--save-hf and the disk publish write through convert/hf_io.py: a transient error writes the shard
    (in memory) again whole, and the temp file of the failed try is not left behind."""
    import torch

    from rlslurm.convert.hf_io import SINGLE_NAME, save_hf_checkpoint

    real, raised = os.fsync, []

    def fsync(fd):
        if len(raised) < 2:
            raised.append(fd)
            raise OSError(errno.ESTALE, "Stale file handle")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    out = tmp_path / "hf"
    save_hf_checkpoint([("w", torch.ones(4))], out, config={"model_type": "qwen3"})
    assert len(raised) == 2 and (out / SINGLE_NAME).exists() and json.loads((out / "config.json").read_text())
    assert sorted(p.name for p in out.iterdir()) == ["config.json", SINGLE_NAME]
