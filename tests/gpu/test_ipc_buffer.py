"""--colocate's weight transport on a GPU (rlslurm/engines/shared_buffer.py), without an engine: a
buffer written by this process is read in place by another one through its CUDA IPC source, twice over
the same buffer (the second read finds torch's cached mapping), at an offset inside the allocation,
and the bytes it sees are those written last. The whole path through SGLang runs in
test_gpu_grpo.py's colocate test."""

from __future__ import annotations

import multiprocessing as mp

import torch


def _reader(conn) -> None:
    from rlslurm.engines.shared_buffer import open_source

    torch.cuda.set_device(0)
    while (src := conn.recv()) is not None:
        t = open_source(src)
        conn.send((t.device.type, t.numel(), int(t.to(torch.int64).sum()), int(t[0]), int(t[-1])))
        del t


def test_a_cuda_buffer_is_read_in_place_by_another_process() -> None:
    from rlslurm.engines.shared_buffer import cuda_source

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_reader, args=(child,), daemon=True)
    proc.start()
    try:
        big = torch.zeros(1 << 22, dtype=torch.uint8, device="cuda")
        n, off = 1 << 20, 4096
        for fill in (3, 7):  # rewritten between the reads: the second read sees the new bytes
            data = torch.full((n,), fill, dtype=torch.uint8, device="cuda")
            data[0], data[-1] = 1, 2
            torch.cat([data], out=big[off:off + n])  # the write is only enqueued: the IPC event orders the read
            parent.send(cuda_source(big[off:off + n]))
            kind, numel, total, first, last = parent.recv()
            assert (kind, numel, first, last) == ("cuda", n, 1, 2)
            assert total == fill * (n - 2) + 3
    finally:
        parent.send(None)
        proc.join(timeout=60)
    del big
    torch.cuda.ipc_collect()
