from __future__ import annotations

import multiprocessing as mp
import os
import zlib

import numpy as np
import pytest

from rlslurm.buffer import CorruptRollout, RolloutReader, RolloutWriter
from rlslurm.buffer.integrity import BLOCK, block_checksums

from .helpers import assert_same, make_samples


def test_block_checksums_ignore_chunk_boundaries():
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 2 * BLOCK + 12345, dtype=np.uint8).tobytes()
    cuts = sorted(rng.integers(0, len(data), 50).tolist())
    chunks = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]
    expected = [f"{zlib.crc32(data[i:i + BLOCK]):08x}" for i in range(0, len(data), BLOCK)]
    assert block_checksums(chunks) == expected
    assert block_checksums([data[:BLOCK]]) == expected[:1]
    assert block_checksums([]) == [f"{zlib.crc32(b''):08x}"]


def _big(rid):
    return make_samples(rid, n=48, response_len=60_000)  # 3 blocks


def test_multi_block_rollout_roundtrip_and_flip_in_one_block(run):
    w, r = RolloutWriter(run), RolloutReader(run)
    info = w.commit(0, _big(0))
    assert info.data_size > 2 * BLOCK
    assert len(w.manifest(0).data_checksum) == -(-info.data_size // BLOCK)
    assert_same(r.read(0), _big(0))
    p = info.data_path
    with open(p, "r+b") as f:
        f.seek(2 * BLOCK + 10)
        b = f.read(1)
        f.seek(2 * BLOCK + 10)
        f.write(bytes([b[0] ^ 0x80]))
    with pytest.raises(CorruptRollout, match=rf"{p}.*block 2"):
        r.read(0)


def _child_read(run_path, q):
    q.put(len(RolloutReader(run_path).read(0).samples))


def test_reader_pool_survives_fork(run):
    RolloutWriter(run).commit(0, _big(0))
    RolloutReader(run).read(0)  # the parent's helper pool now exists
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_read, args=(str(run.path), q))
    p.start()
    assert q.get(timeout=30) == 48
    p.join(10)
    assert p.exitcode == 0
    assert os.getpid()  # parent still fine
    assert len(RolloutReader(run).read(0).samples) == 48
