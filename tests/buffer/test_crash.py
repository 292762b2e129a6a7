"""kill -9 of a writer at random points never leaves a rollout that a reader sees as
committed but incomplete, and the next writer attempt commits cleanly."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time

from rlslurm.buffer import RolloutReader, RolloutWriter, RunDir
from rlslurm.buffer.manifest import parse_data_name, parse_manifest_name

from .helpers import assert_same, make_meta, make_samples

ITERATIONS = 60
TIME_BUDGET_S = 60


def _writer(run_path: str, attempt: int, ready) -> None:
    w = RolloutWriter(run_path, attempt=attempt)
    rid = w.resume_point().next_rollout_id
    ready.set()
    while True:
        # big enough that a random kill usually lands inside write/fsync/rename/link
        w.commit(rid, make_samples(rid, n=8, response_len=2048), make_meta(rid))
        rid += 1


def test_kill9_never_exposes_incomplete_rollout(run):
    ctx = mp.get_context("fork")
    rng = random.Random(1234)
    reader = RolloutReader(run)
    # scale the kill window to how long a commit takes on this machine right now (a
    # loaded CI box can be 10x slower), so kills land before, inside and between commits
    scratch = RunDir.create(run.path.parent / "scratch")
    t0 = time.monotonic()
    for rid in range(3):
        RolloutWriter(scratch).commit(rid, make_samples(rid, n=8, response_len=2048), make_meta(rid))
    window = max(0.02, 4 * (time.monotonic() - t0) / 3)
    verified: set[int] = set()
    iterations_with_debris = 0
    t_start = time.monotonic()
    for attempt in range(ITERATIONS):
        ready = ctx.Event()
        p = ctx.Process(target=_writer, args=(str(run.path), attempt, ready))
        p.start()
        assert ready.wait(10)
        time.sleep(rng.uniform(0, window))
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        assert p.exitcode == -signal.SIGKILL

        ids = reader.committed_ids()
        assert ids == list(range(len(ids))), f"gap in committed ids after kill {attempt}: {ids}"
        for rid in ids:
            if rid not in verified:
                rollout = reader.read(rid)  # raises CorruptRollout on any torn file
                assert_same(rollout, make_samples(rid, n=8, response_len=2048))
                assert rollout.meta.data_cursor == make_meta(rid).data_cursor
                verified.add(rid)
        names = os.listdir(reader.dir)
        referenced = {parse_manifest_name(n) for n in names} - {None}
        debris = [n for n in names if n.startswith(".tmp.") or (parse_data_name(n) not in referenced)]
        debris = [n for n in debris if parse_manifest_name(n) is None]
        iterations_with_debris += bool(debris)
        if attempt % 10 == 9:  # a restarted driver sweeps what killed writers left
            RolloutWriter(run).cleanup(min_age_s=0)
            left = [n for n in os.listdir(reader.dir) if n.startswith(".tmp.") or n.endswith(".data")]
            assert len(left) == len(reader.committed_ids())
        assert time.monotonic() - t_start < TIME_BUDGET_S, "kill -9 loop exceeded its time budget"

    # the kills really landed mid-commit and between commits (else this proves nothing)
    assert iterations_with_debris >= 5, iterations_with_debris
    assert len(reader.committed_ids()) >= 5
    # the next writer attempt commits cleanly from the resume point
    w = RolloutWriter(run, attempt=ITERATIONS)
    rp = w.resume_point()
    n = len(reader.committed_ids())
    assert rp.next_rollout_id == n and rp.data_cursor == make_meta(n - 1).data_cursor
    w.commit(n, make_samples(n), make_meta(n))
    assert_same(reader.wait_for(n, timeout=1), make_samples(n))
