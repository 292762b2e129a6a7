"""A filesystem glitch is not a user error (docs/shared-filesystem.md, "When the filesystem fails"):
EIO / ESTALE / EAGAIN on the run directory are retried with backoff, and one that persists fails the
attempt (exit 1: requeued within --max-failures), never exit 3; ENOSPC is one line naming the full
filesystem and what the write needed, and leaves what was committed intact; a damaged control record
is set aside and rebuilt. Each errno is injected into the calls the primitives make."""

from __future__ import annotations

import errno
import json
import os

import pytest

from rlslurm.buffer import Control, RolloutReader, RolloutWriter, RunDir, atomic
from rlslurm.buffer.atomic import CorruptRecord, StorageFull, TransientStorageError
from rlslurm.errors import UserError
from rlslurm.user_error import USER_ERROR_EXIT_CODE, USER_ERROR_FILE, read_failure, run_role

from .helpers import assert_same, make_meta, make_samples

TRANSIENT = [errno.EIO, errno.ESTALE, errno.EAGAIN]


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch):
    monkeypatch.setattr(atomic, "RETRY_DELAYS_S", (0.01, 0.01, 0.01))


class Flaky:
    """Wraps an os function: the first `times` calls (on paths containing `match`) raise `err`."""

    def __init__(self, fn, err: int, times: int, match: str = ""):
        self.fn, self.err, self.left, self.match, self.raised = fn, err, times, match, 0

    def __call__(self, *args, **kw):
        if self.left and self.match in " ".join(map(str, args)):
            self.left -= 1
            self.raised += 1
            raise OSError(self.err, os.strerror(self.err))
        return self.fn(*args, **kw)


@pytest.mark.parametrize("err", TRANSIENT, ids=errno.errorcode.get)
def test_a_transient_write_error_is_retried(run, monkeypatch, err):
    flaky = Flaky(os.replace, err, times=2, match="router.json")
    monkeypatch.setattr(os, "replace", flaky)
    Control(run).write_router("http://n1:1")
    assert flaky.raised == 2 and Control(run).router().url == "http://n1:1"
    assert [n for n in os.listdir(run.control_dir) if n.startswith(".tmp.")] == []  # each try's temp removed


@pytest.mark.parametrize("err", TRANSIENT, ids=errno.errorcode.get)
def test_a_transient_error_that_persists_fails_the_attempt_not_the_run(run, monkeypatch, err):
    # the rename: a heartbeat is not fsynced (docs/shared-fs-load.md)
    flaky = Flaky(os.replace, err, times=1000)
    monkeypatch.setattr(os, "replace", flaky)
    with pytest.raises(TransientStorageError) as ei:
        Control(run).heartbeat("rollout", 0)
    assert flaky.raised == 4  # the first try and one per backoff delay
    msg = str(ei.value)
    assert "rollout-0.json" in msg and os.strerror(err) in msg and "requeued" in msg and "\n" not in msg
    assert not isinstance(ei.value, UserError)


@pytest.mark.parametrize("err", TRANSIENT, ids=errno.errorcode.get)
def test_a_transient_read_error_is_retried(run, monkeypatch, err):
    c = Control(run)
    c.set_weight_version(3)
    flaky_open = Flaky(os.open, err, times=2, match="weight_version")
    monkeypatch.setattr(os, "open", flaky_open)
    assert c.weight_version().version == 3 and flaky_open.raised == 2
    listing = Flaky(os.listdir, err, times=2, match=str(run.control_dir))
    monkeypatch.setattr(os, "listdir", listing)
    assert "weight_version.json" in atomic.listdir_fresh(run.control_dir) and listing.raised == 2


@pytest.mark.parametrize("err", TRANSIENT, ids=errno.errorcode.get)
def test_a_commit_and_an_append_survive_a_transient_error(run, tmp_path, monkeypatch, err):
    """The commit's data rename and its manifest publish, and an appended line, each hit once."""
    w, r = RolloutWriter(run), RolloutReader(run)
    monkeypatch.setattr(os, "replace", Flaky(os.replace, err, times=1, match=".data"))
    monkeypatch.setattr(os, "link", Flaky(os.link, err, times=1, match="manifest"))
    w.commit(0, make_samples(0), make_meta(0))
    assert r.committed_ids() == [0]
    assert_same(r.read(0), make_samples(0))
    log = tmp_path / "metrics.jsonl"
    monkeypatch.setattr(os, "fsync", Flaky(os.fsync, err, times=1))
    atomic.append_line(log, b'{"step": 0}\n', "the metrics of step 0")
    assert log.read_bytes() == b'{"step": 0}\n'  # the failed try's bytes were cut back off


def test_a_publish_whose_link_landed_before_the_error_is_won(run, monkeypatch):
    """EIO after the link succeeded (the reply lost): the retry finds the name holding exactly our
    bytes, so this writer won: no rollout reported as committed by another writer."""
    real = os.link

    def link_then_eio(src, dst, *a, **kw):
        real(src, dst, *a, **kw)
        monkeypatch.setattr(os, "link", real)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "link", link_then_eio)
    assert atomic.publish_exclusive(run.control_dir / "once.json", b"{}\n")
    assert not atomic.publish_exclusive(run.control_dir / "once.json", b"{}\n")  # a later writer does lose


def test_enospc_names_the_filesystem_and_what_was_needed(small_fs):
    run = RunDir.create(small_fs / "run")
    w, r = RolloutWriter(run), RolloutReader(run)
    w.commit(0, make_samples(0), make_meta(0))
    with pytest.raises(StorageFull) as ei:
        for rid in range(1, 100):
            w.commit(rid, make_samples(rid, n=8, response_len=4096), make_meta(rid))
    msg = str(ei.value)
    assert not isinstance(ei.value, UserError) and "\n" not in msg
    assert "no space left on device" in msg and f"filesystem {small_fs} (tmpfs)" in msg and "free of 1.0 MiB" in msg
    assert "it needs" in msg and "intact" in msg
    assert 0 in r.committed_ids()
    assert_same(r.read(0), make_samples(0))


def test_a_damaged_control_record_is_set_aside_and_rebuilt(run):
    c = Control(run)
    c.set_weight_version(5)
    path = run.control_dir / "weight_version.json"
    path.write_bytes(b'{"version": 5, "upd')  # a block the filesystem lost
    with pytest.raises(CorruptRecord, match="weight_version.json.*set aside") as ei:
        c.weight_version()
    assert not isinstance(ei.value, UserError)
    assert c.weight_version() is None  # the next attempt does not trip over it ...
    c.set_weight_version(5)  # ... and its writer rebuilds it
    assert c.weight_version().version == 5
    [aside] = [n for n in os.listdir(run.control_dir) if n.startswith(".corrupt.weight_version.json.")]
    assert (run.control_dir / aside).read_bytes() == b'{"version": 5, "upd'  # kept for a post-mortem


def test_a_record_rewritten_while_it_is_set_aside_is_kept(run):
    """The writer replaced the damaged file between the reader's read and its move: the good version
    goes back to its name, and the reader reads that."""
    c = Control(run)
    path = run.control_dir / "router.json"
    path.write_bytes(b"garbage")
    ino = path.stat().st_ino
    c.write_router("http://n1:2")  # the writer, just after the reader read the garbage
    assert atomic.set_aside(path, ino) is None
    assert c.router().url == "http://n1:2"
    assert not [n for n in os.listdir(run.control_dir) if n.startswith(".corrupt.")]


def test_a_damaged_heartbeat_is_skipped(run):
    c = Control(run)
    c.heartbeat("trainer", 0)
    (run.control_dir / "heartbeats" / "trainer-1.json").write_bytes(b"\0\0\0")
    assert [(h.role, h.rank) for h in c.heartbeats()] == [("trainer", 0)]


def _role_main(fail):
    def main(argv):
        fail()
        return 0
    return main


@pytest.mark.parametrize("err", [*TRANSIENT, errno.ENOSPC], ids=errno.errorcode.get)
def test_a_role_that_hits_the_filesystem_fails_without_a_user_error(run, monkeypatch, capsys, err):
    """run_role (every role's __main__): a StorageError exits 1, the attempt's failure, and records no
    user_error.json (which would end the job without requeue); a UserError still exits 3."""
    monkeypatch.setenv("RLSLURM_ATTEMPT", "0")
    monkeypatch.setattr(os, "replace", Flaky(os.replace, err, times=1000, match="rollout-0.json"))

    with pytest.raises(SystemExit) as ei:
        run_role("rollout", _role_main(lambda: Control(run).heartbeat("rollout", 0)), lambda argv: run.path)
    monkeypatch.undo()
    assert ei.value.code == 1
    err_lines = [l for l in capsys.readouterr().err.splitlines() if l.startswith("rlslurm rollout: error:")]
    assert len(err_lines) == 1 and "rollout-0.json" in err_lines[0]
    assert not (run.attempt_log_dir(0) / USER_ERROR_FILE).exists()
    assert "rollout-0.json" in read_failure(run.attempt_log_dir(0))["reason"]  # the ledger's "failed: ..." line
    (run.attempt_log_dir(0) / "failure.json").unlink()

    def user_error():
        raise UserError("--flag: bad")

    monkeypatch.setenv("RLSLURM_ATTEMPT", "0")
    with pytest.raises(SystemExit) as ei:
        run_role("rollout", _role_main(user_error), lambda argv: run.path)
    assert ei.value.code == USER_ERROR_EXIT_CODE
    assert json.loads((run.attempt_log_dir(0) / USER_ERROR_FILE).read_text())["reason"] == "user error: --flag: bad"


def test_the_eio_test_hook_fails_every_try_while_its_file_exists(run, tmp_path, monkeypatch):
    """RLSLURM_TEST_EIO_FILE (bench/bench_chaos.py's injected EIO in a real run): while the file is there
    every try fails with EIO before touching the run dir; once it is gone the retry goes through."""
    trigger = tmp_path / "eio"
    monkeypatch.setattr(atomic, "_TEST_EIO_FILE", str(trigger))
    trigger.touch()
    with pytest.raises(TransientStorageError, match="injected: RLSLURM_TEST_EIO_FILE"):
        Control(run).write_router("http://n1:1")
    tries = []

    def sleep(s):  # the window closes during the first backoff
        tries.append(s)
        trigger.unlink(missing_ok=True)

    monkeypatch.setattr(atomic.time, "sleep", sleep)
    trigger.touch()
    Control(run).write_router("http://n1:2")
    assert tries == [0.01] and Control(run).router().url == "http://n1:2"


def test_the_eio_test_hook_can_be_narrowed_to_the_first_try_on_some_paths(run, tmp_path, monkeypatch):
    """bench/bench_chaos.py's eio_ckpt: `first:/checkpoints/` in the file fails only the first try of each
    operation under RUN/checkpoints (each then goes on), leaving the rest of the run alone."""
    trigger = tmp_path / "eio"
    monkeypatch.setattr(atomic, "_TEST_EIO_FILE", str(trigger))
    trigger.write_text("first:/checkpoints/\n")
    Control(run).write_router("http://n1:1")  # not under checkpoints/: untouched
    tries = []
    monkeypatch.setattr(atomic.time, "sleep", tries.append)
    atomic.write_json_atomic(run.checkpoints_dir / "latest", {"name": "iter_0000004"})
    assert tries == [0.01] and json.loads((run.checkpoints_dir / "latest").read_text())["name"] == "iter_0000004"
