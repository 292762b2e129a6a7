"""The checkpoint staging area (rlslurm/trainer/checkpoint/staging.py): what the trainer copies in, a forked
writer reads back byte for byte from the descriptor alone, each tensor saved as itself, and the area
is reused by the next save rather than allocated again."""

from __future__ import annotations

import io
import multiprocessing as mp
import pickle

import torch

from rlslurm.trainer.checkpoint import staging
from rlslurm.trainer.checkpoint.staging import StagingArea, open_slots


def _tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(6, 10, generator=g)
    return [
        torch.randn(7, 3, generator=g).to(torch.bfloat16),
        wide[:, ::3],                                   # not contiguous: staged as its values
        torch.randint(0, 1 << 40, (5,), generator=g),   # int64
        torch.rand(9, generator=g) > 0.5,               # bool, odd byte count
        torch.empty(0, 4),                              # nothing to copy
        torch.tensor(3.5, dtype=torch.float64),         # a scalar
    ]


def _writer(fd: int, size: int, slots_pickled: bytes, send) -> None:
    """A forked writer: only the descriptor, the size and the slots cross (as in writer._child)."""
    out = []
    for t in open_slots(fd, size, pickle.loads(slots_pickled)):
        buf = io.BytesIO()
        torch.save(t, buf)
        out.append((buf.getvalue(), t.untyped_storage().nbytes()))
    send.send(out)


def _read_in_fork(area: StagingArea, slots) -> list[tuple[torch.Tensor, int]]:
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_writer, args=(area.fd, area.size, pickle.dumps(slots), send))
    p.start()
    out = recv.recv()
    p.join()
    assert p.exitcode == 0
    return [(torch.load(io.BytesIO(b)), n) for b, n in out]


def test_a_forked_writer_reads_each_staged_tensor_exactly_and_the_area_is_reused(monkeypatch) -> None:
    monkeypatch.setattr(staging, "GROW", 1 << 16)  # a small area: the growth below stays cheap
    area = StagingArea()
    try:
        first = _tensors(0)
        slots = area.stage(first)
        assert area.staging == "pageable"  # CPU tensors: nothing to page-lock for
        fd, size = area.fd, area.size
        for want, (got, storage) in zip(first, _read_in_fork(area, slots)):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got, want)
            assert storage == want.numel() * want.element_size()  # the tensor alone, not the area
        # the next save rewrites the same area: its writer sees the new values, not the old ones
        second = _tensors(1)
        assert area.stage(second) == slots
        assert (area.fd, area.size) == (fd, size)
        assert all(torch.equal(g, w) for w, (g, _) in zip(second, _read_in_fork(area, slots)))
        # an area reserved ahead (in the background, as the trainer does once its model is built) is
        # the one the first save uses: no second allocation inside the save's stall
        ahead = StagingArea()
        ahead.reserve(200_000, pin=False)
        ahead._reserving.join()
        fd_ahead, size_ahead = ahead.fd, ahead.size
        assert fd_ahead is not None and size_ahead >= 200_000
        slots_ahead = ahead.stage(first)
        assert (ahead.fd, ahead.size) == (fd_ahead, size_ahead)
        assert all(torch.equal(g, w) for w, (g, _) in zip(first, _read_in_fork(ahead, slots_ahead)))
        ahead.close()
        # a rank with nothing to write still hands its writer an area to map
        empty = StagingArea()
        assert empty.stage([]) == [] and empty.fd is not None
        empty.close()
        # a save larger than the area grows it
        big = [torch.ones(size // 4 + 1, dtype=torch.float32)]
        (slot,) = area.stage(big)
        assert area.size > size
        ((got, _),) = _read_in_fork(area, [slot])
        assert torch.equal(got, big[0])
    finally:
        area.close()
