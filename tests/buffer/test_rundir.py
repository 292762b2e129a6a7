from __future__ import annotations

import multiprocessing as mp
import os
import stat

import pytest

from rlslurm.buffer import RunDir
from rlslurm.errors import ConfigError


def _mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
def test_private_by_default_whatever_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        rd = RunDir.create(tmp_path / "a" / "b" / "run")
    finally:
        os.umask(old)
    assert _mode(rd.path) == 0o700
    for sub in (rd.control_dir, rd.buffer_dir, rd.weights_dir, rd.checkpoints_dir, rd.logs_dir, rd.tb_dir):
        assert sub.is_dir() and _mode(sub) == 0o700


def test_group_shared_is_setgid_0750(tmp_path):
    old = os.umask(0o077)
    try:
        rd = RunDir.create(tmp_path / "run", group_shared=True)
    finally:
        os.umask(old)
    assert _mode(rd.path) == 0o2750
    assert _mode(rd.buffer_dir) == 0o2750


def test_refuses_foreign_nonempty_dir_naming_it(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "precious.txt").write_text("x")
    with pytest.raises(ConfigError, match=str(d)):
        RunDir.create(d)
    assert (d / "precious.txt").read_text() == "x"
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(ConfigError, match="not a directory"):
        RunDir.create(f)


def test_create_is_idempotent_and_empty_dir_ok(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    rd = RunDir.create(d)
    (rd.control_dir / "router.json").write_text("{}")
    again = RunDir.create(d)
    assert again.is_run_dir()
    assert (again.control_dir / "router.json").exists()


def test_layout_names(tmp_path):
    rd = RunDir(tmp_path / "r")  # no I/O
    assert not (tmp_path / "r").exists()
    assert rd.run_yaml.name == "run.yaml" and rd.job_sbatch.name == "job.sbatch"
    assert rd.ledger.name == "ledger.jsonl" and rd.metrics.name == "metrics.jsonl"
    assert rd.finished.name == "FINISHED"
    assert rd.attempt_log_dir(0) == rd.logs_dir / "attempt-0"
    assert rd.attempt_log_dir(3) == rd.logs_dir / "attempt-3"
    with pytest.raises(ConfigError):
        rd.attempt_log_dir(-1)


def test_api_key_0600_created_once(run):
    with pytest.raises(ConfigError, match="api_key"):
        run.api_key()
    k1 = run.ensure_api_key()
    k2 = run.ensure_api_key()
    assert k1 == k2 == run.api_key() and len(k1) >= 32
    assert _mode(run.api_key_file) == 0o600
    assert [n for n in os.listdir(run.control_dir) if n.startswith(".tmp")] == []


def _race_key(path, q):
    q.put(RunDir(path).ensure_api_key())


@pytest.mark.parametrize("damage", [b"", b"\x00" * 65, b"not-a-key\n"])
def test_a_damaged_api_key_fails_the_attempt_and_is_made_anew(run, damage):
    """control/api_key damaged on disk was a ConfigError (a user error: the job ended, on every resubmit).
    Now a reader's CorruptRecord fails the attempt (requeued), and the next attempt's rollout node sets
    the damaged file aside and makes a new key that every process of that attempt reads."""
    from rlslurm.buffer.atomic import CorruptRecord
    from rlslurm.errors import UserError

    old = run.ensure_api_key()
    run.api_key_file.write_bytes(damage)
    with pytest.raises(CorruptRecord, match="api_key: damaged on disk") as e:
        run.api_key()
    assert not isinstance(e.value, UserError)
    new = run.ensure_api_key()
    assert new != old and new == run.api_key() and _mode(run.api_key_file) == 0o600
    assert [n for n in os.listdir(run.control_dir) if n.startswith(".corrupt.api_key.")]


def test_api_key_race_all_get_the_same_key(run):
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_race_key, args=(str(run.path), q)) for _ in range(6)]
    for p in procs:
        p.start()
    keys = {q.get(timeout=30) for _ in procs}
    for p in procs:
        p.join(10)
    assert len(keys) == 1 and keys == {run.api_key()}


def test_finished(run):
    assert not run.is_finished()
    run.mark_finished({"rollouts": 20})
    assert run.is_finished()
    assert run.finished_info()["rollouts"] == 20


def test_dirs_made_later_inherit_the_run_dir_mode(tmp_path):
    from rlslurm.buffer import Control, RolloutReader, RolloutWriter

    from .helpers import make_samples

    old = os.umask(0o077)
    try:
        rd = RunDir.create(tmp_path / "run", group_shared=True)
        RolloutWriter(rd, kind="eval").commit(0, make_samples(0))
        Control(rd).heartbeat("driver", 0)
        RolloutReader(rd, kind="eval").quarantine(0, "test")
    finally:
        os.umask(old)
    assert _mode(rd.buffer_dir / "eval") == 0o2750
    assert _mode(rd.control_dir / "heartbeats") == 0o2750
    assert _mode(rd.buffer_dir / "quarantine") == 0o2750
    data = [p for p in (rd.buffer_dir / "quarantine").rglob("*.data")]
    assert data and _mode(data[0]) == 0o640


@pytest.mark.parametrize("group_shared,mode,chmods", [(False, 0o600, 0), (True, 0o640, 1)])
def test_heartbeats_under_the_jobs_umask_cost_a_chmod_only_in_a_group_shared_run(tmp_path, monkeypatch, group_shared,
                                                                                  mode, chmods):
    """Under the batch script's umask 077 a 0640 file needs a chmod, a metadata round trip of its own,
    at every write: a third of a heartbeat (every 30 s per node, docs/shared-fs-load.md). In a private
    run (0700) the group cannot enter the directory, so a heartbeat is 0600 and needs none; in a
    group-shared one it stays group-readable for `rlslurm status`."""
    from rlslurm.buffer.control import Control

    rd = RunDir.create(tmp_path / "run", group_shared=group_shared)
    calls = []
    real = os.fchmod
    monkeypatch.setattr(os, "fchmod", lambda fd, m: calls.append(m) or real(fd, m))
    old = os.umask(0o077)
    try:
        control = Control(rd)
        for _ in range(3):
            control.heartbeat("rollout", 1)
    finally:
        os.umask(old)
    assert _mode(control.heartbeat_dir / "rollout-1.json") == mode and len(calls) == 3 * chmods
    assert [hb.rank for hb in control.heartbeats()] == [1]
