"""Concurrent readers and writers in several processes: no corruption, no id committed
twice, losers of a commit race leave nothing behind."""

from __future__ import annotations

import multiprocessing as mp
import os

from rlslurm.buffer import AlreadyCommitted, RolloutMeta, RolloutReader, RolloutWriter

from .helpers import assert_same, make_samples

N_IDS = 24
N_WRITERS = 3
N_READERS = 3


def _writer(run_path: str, seed: int, q) -> None:
    w = RolloutWriter(run_path)
    won = []
    # every writer tries every id: each id is raced by all writers
    order = list(range(N_IDS)) if seed % 2 == 0 else list(range(N_IDS))[::-1]
    for rid in order:
        try:
            w.commit(rid, make_samples(rid, n=6, response_len=512, seed=seed), RolloutMeta(extra={"seed": seed}))
            won.append(rid)
        except AlreadyCommitted:
            pass
    q.put(("writer", seed, won))


def _reader(run_path: str, q) -> None:
    r = RolloutReader(run_path)
    seeds = {}
    for rid in range(N_IDS):
        rollout = r.wait_for(rid, timeout=60, poll_interval=0.01)
        seed = rollout.meta.extra["seed"]
        assert_same(rollout, make_samples(rid, n=6, response_len=512, seed=seed))
        seeds[rid] = seed
    q.put(("reader", seeds))


def test_concurrent_writers_and_readers(run):
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_reader, args=(str(run.path), q)) for _ in range(N_READERS)]
    procs += [ctx.Process(target=_writer, args=(str(run.path), s, q)) for s in range(N_WRITERS)]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    wins = {}
    for res in results:
        if res[0] == "writer":
            for rid in res[2]:
                assert rid not in wins, f"rollout {rid} committed by two writers"
                wins[rid] = res[1]
    assert sorted(wins) == list(range(N_IDS))
    for res in results:
        if res[0] == "reader":
            assert res[1] == wins  # every reader saw the winner's content
    r = RolloutReader(run)
    assert r.committed_ids() == list(range(N_IDS))
    names = os.listdir(r.dir)
    assert len([n for n in names if n.endswith(".data")]) == N_IDS
    assert [n for n in names if n.startswith(".tmp.")] == []
