"""Asynchronous checkpoints (rlslurm/trainer/checkpoint/writer.py, checkpointer.py `Checkpointer`): the trainer
trains on while forked writers write a save, `latest` moves only once it is complete and verified, a
SIGKILL mid-save leaves the previous checkpoint the one resumed, and a full disk during a save is one
line naming the filesystem, with the last checkpoint intact. Writes are held by the test hook
RLSLURM_TEST_SAVE_DELAY_S, standing in for a real model's save."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from conftest import (
    commit_rollouts,
    kill_tree,
    make_run,
    metrics,
    run_trainer,
    start_attempt_trainer as start,
    wait_trained,
)

from rlslurm.trainer.checkpoint import META, verify
from rlslurm.trainer.checkpoint.writer import TEST_SAVE_DELAY_ENV

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

TRAIN = dict(save_interval=2, keep_checkpoints=2, num_steps_per_rollout=1, global_batch_size=8, micro_batch_size=2,
             weight_sync="disk")


def _latest(run: Path) -> str:
    return json.loads((run / "checkpoints" / "latest").read_text())["name"]


def test_sigkill_mid_save_resumes_from_the_previous_checkpoint(tmp_path: Path, tiny_hf: Path) -> None:
    run = make_run(tmp_path / "run", tiny_hf, nproc=2, train=TRAIN, rollout=dict(num_rollout=6))
    commit_rollouts(run, range(2))
    # attempt 0: checkpoint 2, written in the background, becomes latest while the trainer waits
    log0 = tmp_path / "attempt0.log"
    proc = start(run, log0, {})
    try:
        deadline = time.monotonic() + 240
        while not (run / "checkpoints" / "latest").exists():
            assert proc.poll() is None and time.monotonic() < deadline, log0.read_text()[-6000:]
            time.sleep(0.3)
    finally:
        kill_tree(proc)
    assert _latest(run) == "iter_0000002" and verify(run / "checkpoints" / "iter_0000002") is None
    # attempt 1: the write of checkpoint 4 is held 60 s; the trainer trains rollout 4 meanwhile (and 5,
    # whose metrics are logged after its own save, which first waits for checkpoint 4)
    commit_rollouts(run, range(2, 6))
    log1 = tmp_path / "attempt1.log"
    proc = start(run, log1, {TEST_SAVE_DELAY_ENV: "60"})
    try:
        wait_trained(run, proc, log1, 5)  # rollouts 0-4, one step each
        held = run / "checkpoints" / "iter_0000004"
        assert held.is_dir() and not (held / META).exists(), log1.read_text()[-6000:]  # still being written
        assert _latest(run) == "iter_0000002"
        assert [l["rollout_id"] for l in metrics(run)][-1] == 4  # trained on after checkpoint 4 was handed off
    finally:
        kill_tree(proc)  # SIGKILL mid-save: writers and all
    assert _latest(run) == "iter_0000002" and not (held / META).exists()
    # attempt 2: resumes from checkpoint 2 (4 never completed), trains 2-5 again and finishes
    p = run_trainer(run, nproc=2, timeout=300)
    assert "resumed from" in p.stderr and "iter_0000002" in p.stderr, p.stderr[-4000:]
    assert (run / "FINISHED").exists() and _latest(run) == "iter_0000006"
    assert verify(run / "checkpoints" / "iter_0000006") is None and verify(held) is None  # 4 re-saved whole


@pytest.fixture
def full_checkpoints(tmp_path: Path):
    """The run's checkpoints directory on a 2 MiB tmpfs: room for one tiny checkpoint (1.3 MiB), not two."""
    from rlslurm.buffer import RunDir

    run = RunDir.create(tmp_path / "run").path
    mnt = run / "checkpoints"
    mnt.mkdir(exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mnt)], capture_output=True,
                         text=True)
    if res.returncode != 0:
        if os.environ.get("CI"):
            pytest.fail(res.stderr)
        pytest.skip(f"cannot mount a tmpfs: {res.stderr.strip()}")
    try:
        yield run
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _run_to_its_error_line(run: Path, tiny_hf: Path) -> tuple[subprocess.CompletedProcess, str]:
    """A 4-rollout run of 2 ranks that must fail: the finished trainer and its first error line."""
    make_run(run, tiny_hf, nproc=2, train=TRAIN, rollout=dict(num_rollout=4))
    commit_rollouts(run, range(4))
    p = run_trainer(run, nproc=2, timeout=300, check=False)
    assert p.returncode != 0
    lines = [l for l in p.stderr.splitlines() if "rlslurm trainer: error:" in l]
    assert lines, p.stderr[-6000:]
    return p, lines[0][lines[0].index("rlslurm trainer: error:"):]


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_last_checkpoint(full_checkpoints: Path,
                                                                             tiny_hf: Path) -> None:
    run = full_checkpoints
    p, line = _run_to_its_error_line(run, tiny_hf)
    assert "no space left on device while saving checkpoint iter_0000004" in line, line
    assert f"filesystem {run / 'checkpoints'} (tmpfs)" in line and "free of 2.0 MiB" in line, line
    assert "a checkpoint of this run takes" in line and "(iter_0000002), which is intact" in line, line
    assert "this attempt fails (requeued within --max-failures)" in p.stderr
    assert not list((run / "logs").rglob("user_error.json"))  # not final
    [failure] = list((run / "logs").rglob("failure.json"))  # the ledger's reason: this line
    assert "saving checkpoint iter_0000004" in json.loads(failure.read_text())["reason"]
    assert _latest(run) == "iter_0000002" and verify(run / "checkpoints" / "iter_0000002") is None
    assert not (run / "checkpoints" / "iter_0000004").exists()  # the partial save is gone, its space free


def test_the_save_delay_hook_reads_a_file_at_each_save(tmp_path: Path, monkeypatch) -> None:
    """RLSLURM_TEST_SAVE_DELAY_S=@PATH: the seconds come from PATH at each save (bench/bench_chaos.py
    opens the window mid-run); no file: no delay."""
    from rlslurm.trainer.checkpoint import writer

    f = tmp_path / "delay"
    monkeypatch.setenv(TEST_SAVE_DELAY_ENV, f"@{f}")
    assert writer._test_delay() == 0.0
    f.write_text("35\n")
    assert writer._test_delay() == 35.0
    f.write_text("")
    assert writer._test_delay() == 0.0
    monkeypatch.setenv(TEST_SAVE_DELAY_ENV, "7")
    assert writer._test_delay() == 7.0


_RANK = r"""
import mmap, multiprocessing as mp, os, queue, sys, time
from pathlib import Path
from rlslurm.trainer.checkpoint import writer

def write(_, buckets, q):  # megatron's write of this rank's files, slow
    time.sleep(3)
    q.put({})

fd = os.memfd_create("area")
os.ftruncate(fd, 4096)
ctx = mp.get_context("fork")
recv, send = ctx.Pipe(duplex=False)
writer._JOB = (write, (None, []), Path(sys.argv[1]), 0, send, (fd, 4096))
writer._JOB_PARENT = os.getpid()
p = ctx.Process(target=writer._child, name="rlslurm-ckpt-writer-0")
p.start()
print(p.pid, flush=True)
time.sleep(60)
"""


def test_a_writer_whose_rank_is_killed_ends_and_publishes_nothing(tmp_path: Path) -> None:
    """kill -9 of a rank mid-save (bench/bench_chaos.py ckpt_kill): its forked writer, which ignores the
    step's TERM, ends within a poll instead of writing on and publishing its results file into a
    directory a later attempt may re-save under the same name. Before the fix it ran on."""
    import signal
    import sys

    from rlslurm.engines import procfs

    results = tmp_path / ".rlslurm-write-0.pkl"
    rank = subprocess.Popen([sys.executable, "-c", _RANK, str(results)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    try:
        writer = int(rank.stdout.readline())
        rank.kill()
        rank.wait()
        deadline = time.monotonic() + 2.5
        while procfs.state(writer) not in (None, "Z") and time.monotonic() < deadline:
            time.sleep(0.05)
        gone = procfs.state(writer) in (None, "Z")
        time.sleep(4)  # past the write: an orphan would publish its results now
        assert gone and not results.exists(), (procfs.state(writer), results.exists())
    finally:
        rank.kill()
        try:
            os.kill(writer, signal.SIGKILL)
        except (OSError, UnboundLocalError):
            pass


def test_a_disk_full_before_the_first_save_is_one_line_too(full_checkpoints: Path, tiny_hf: Path) -> None:
    """Found by bench/bench_chaos.py fs_full (issue 31 item 7): RUN/checkpoints filled before the run's first
    save. Rank 0's common.pt (torch.save) then fails as a RuntimeError ("basic_ios::clear: iostream error",
    "unexpected pos 64 vs 0": torch's zip writer drops the errno), which went out as a traceback: no line
    naming the filesystem, no failure.json, a ledger reason that says only "trainer step ended first"."""
    run = full_checkpoints
    mnt = run / "checkpoints"
    with open(mnt / "filler", "wb", buffering=0) as f:
        for chunk in (1 << 20, 1 << 12, 1 << 9):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError:
                pass
    p, line = _run_to_its_error_line(run, tiny_hf)
    assert "no space left on device while saving checkpoint iter_0000002" in line, line
    assert f"filesystem {mnt} (tmpfs)" in line and "this is the run's first checkpoint" in line, line
    assert not list((run / "logs").rglob("user_error.json"))
    [failure] = list((run / "logs").rglob("failure.json"))
    assert "saving checkpoint iter_0000002" in json.loads(failure.read_text())["reason"]
    assert not (mnt / "iter_0000002" / META).exists() and not (mnt / "latest").exists()  # never resumed from


def test_every_step_of_a_save_rides_out_an_eio(tmp_path: Path, tiny_hf: Path) -> None:
    """The first try of every operation of a save under RUN/checkpoints fails with EIO (the test hook
    RLSLURM_TEST_EIO_FILE with `first:/checkpoints/`, bench/bench_chaos.py's eio_ckpt): each rank's
    forked write, its results, .metadata, rlslurm.json's checksums, the verify and `latest` are each
    retried, and the save completes, verified, in the same attempt. Before, the first EIO failed it."""
    run = make_run(tmp_path / "run", tiny_hf, nproc=2, train=TRAIN, rollout=dict(num_rollout=2))
    commit_rollouts(run, range(2))
    eio = tmp_path / "eio"
    eio.write_text("first:/checkpoints/\n")
    log = tmp_path / "trainer.log"
    proc = start(run, log, {"RLSLURM_TEST_EIO_FILE": str(eio)})
    try:
        proc.wait(300)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    text = log.read_text()
    assert proc.returncode == 0 and (run / "FINISHED").exists(), text[-6000:]
    assert _latest(run) == "iter_0000002" and verify(run / "checkpoints" / "iter_0000002") is None
    for what in ("writing the checkpoint files of rank 0", "writing the checkpoint files of rank 1",
                 "writing .metadata", "syncing and summing the checkpoint's files", "verifying the checkpoint",
                 "writing latest"):
        assert f"(injected: RLSLURM_TEST_EIO_FILE) while {what}; retrying" in text, what
