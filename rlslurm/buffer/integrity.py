"""Checksums of data files, computed and verified off the critical path.

A data file is checksummed as independent 4 MiB blocks (crc32 each, listed in the
manifest) instead of one crc over the whole file, because blocks can be verified in
parallel: a reader `pread`s and checks several blocks at once on several cores (both
release the GIL), and a writer computes them in a helper thread while its own thread
is busy in write/fsync. crc32 (zlib) detects every burst error up to 32 bits and any
truncation (the size is checked too); it guards against storage faults, not attackers.
"""

from __future__ import annotations

import os
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterable, Sequence

import numpy as np

ALGORITHM = "crc32/4MiB"
BLOCK = 4 << 20
_MAX_WORKERS = 4

_pool: ThreadPoolExecutor | None = None
_pool_pid = -1
_pool_lock = threading.Lock()


def pool() -> ThreadPoolExecutor:
    """A process-wide helper pool, rebuilt after fork (a forked child inherits the
    parent's executor object but none of its threads)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(max_workers=min(_MAX_WORKERS, os.cpu_count() or 1),
                                       thread_name_prefix="rlslurm-crc")
            _pool_pid = os.getpid()
        return _pool


def block_checksums(chunks: Iterable[bytes | memoryview]) -> list[str]:
    """crc32 of each BLOCK-sized block of the concatenation of `chunks`."""
    out: list[str] = []
    crc, filled = 0, 0
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        while view.nbytes:
            take = min(BLOCK - filled, view.nbytes)
            crc = zlib.crc32(view[:take], crc)
            filled += take
            view = view[take:]
            if filled == BLOCK:
                out.append(f"{crc:08x}")
                crc, filled = 0, 0
    if filled or not out:
        out.append(f"{crc:08x}")
    return out


def block_checksums_async(chunks: Sequence[bytes | memoryview], size: int) -> Future[list[str]] | list[str]:
    """Start computing the checksums in the helper pool (for large data), so the caller
    can write meanwhile; small data is done inline."""
    if size < BLOCK:
        return block_checksums(chunks)
    return pool().submit(block_checksums, chunks)


def read_verified(fd: int, size: int, expected: list[str]) -> tuple[np.ndarray, int | None]:
    """Read `size` bytes from `fd` and verify each block. Returns (buffer, index of the
    first bad block or None). np.empty, unlike bytearray, does not zero-fill first."""
    buf = np.empty(size, dtype=np.uint8)
    view = memoryview(buf)
    offsets = list(range(0, size, BLOCK)) or [0]

    def one(i: int) -> bool:
        off = offsets[i]
        end = min(off + BLOCK, size)
        pos = off
        while pos < end:
            n = os.preadv(fd, [view[pos:end]], pos)
            if n == 0:
                return False  # file shrank under us
            pos += n
        return f"{zlib.crc32(view[off:end]):08x}" == expected[i]

    if len(offsets) != len(expected):
        return buf, 0
    if len(offsets) == 1:
        ok = [one(0)]
    else:
        ok = list(pool().map(one, range(len(offsets))))
    bad = next((i for i, good in enumerate(ok) if not good), None)
    return buf, bad
