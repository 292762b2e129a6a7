"""A reader waiting in another process sees a commit within 1 s, including when its
directory listing was read just before the commit."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest

from rlslurm.buffer import RolloutReader, RolloutWriter, reader as reader_mod
from rlslurm.buffer.manifest import manifest_name

from .helpers import assert_same, make_samples

N = 4


def _reader(run_path: str, poll: float, listed, q) -> None:
    orig = reader_mod.listdir_fresh

    def listing_then_signal(path):
        names = orig(path)
        if not listed.is_set():
            listed.set()  # the parent commits now: this listing is stale by design
            q.put(("listing", names))
        return names

    reader_mod.listdir_fresh = listing_then_signal
    r = RolloutReader(run_path)
    for rid in range(N):
        rollout = r.wait_for(rid, timeout=20, poll_interval=poll)
        q.put(("seen", rid, time.time(), len(rollout.samples)))


@pytest.mark.parametrize("poll", [0.05, 0.2])
def test_commit_visible_within_one_second(run, poll):
    ctx = mp.get_context("fork")
    listed, q = ctx.Event(), ctx.Queue()
    p = ctx.Process(target=_reader, args=(str(run.path), poll, listed, q))
    p.start()
    w = RolloutWriter(run)
    try:
        for rid in range(N):
            assert listed.wait(20)
            kind, names = q.get(timeout=5)
            assert manifest_name(rid) not in names  # the reader listed before the commit
            info = w.commit(rid, make_samples(rid))
            kind, seen_rid, seen_at, n = q.get(timeout=20)
            assert (kind, seen_rid, n) == ("seen", rid, 8)
            latency = seen_at - info.committed_at
            assert 0 <= latency < 1.0, f"rollout {rid} seen {latency:.3f} s after commit (poll {poll})"
            listed.clear()
    finally:
        p.join(20)
        if p.is_alive():
            p.kill()
    assert p.exitcode == 0
    assert_same(RolloutReader(run).read(N - 1), make_samples(N - 1))
