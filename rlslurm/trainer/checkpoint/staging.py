"""Where an asynchronous checkpoint's copy of the state lives between the trainer and its forked
writer (writer.py; docs/checkpoints.md, "The staging area").

The copy off the GPU is the whole training stall of an asynchronous save, so its speed is the host memory it
lands in: into fresh pageable memory it runs far below PCIe speed, into page-locked memory a device-to-host
copy runs at PCIe speed (bench/results/checkpoint-h100x4.md). Page-locked memory from CUDA's allocator is not
inherited by a forked process (the driver marks it so a child cannot disturb the DMA mapping), and the writer
is a fork. So the area is a memfd (shared memory with a file descriptor), mapped here and registered with CUDA
(`cudaHostRegister`): the trainer copies into it at page-locked speed, and the writer, which inherits the
descriptor whether or not it inherits the mapping, maps it again and reads each tensor from its own offset
(`torch.frombuffer`: a storage of exactly that tensor, so the writer's `torch.save` writes that tensor's bytes
and nothing around them).

One area per trainer process, kept for the run and grown when a save needs more: the pages are
touched and locked once, not at every save. Touching and locking them is slow (seconds per few GiB,
bench/results/checkpoint-h100x4.md), so the trainer reserves the area in the
background as soon as its model is built (`reserve`, sized by state.py `staging_estimate`),
while it waits for the engines and the first rollout; a save that comes first waits for it. Its size is this rank's
share of a checkpoint, held in host memory from the first save on (the log says how much). A save starts only after the
previous one's writer is gone (checkpointer.py `Checkpointer.start` waits), so the area is never rewritten
under a writer. Where registration fails the copy still lands in the area at pageable speed, and
the save says so (`writer.RankWrite.staging`, the trainer's log at every save).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

ALIGN = 512  # bytes: every tensor starts on a boundary any dtype and a DMA engine are happy with
GROW = 1 << 30  # round the area up to whole GiB, so a slightly larger save does not re-register it


@dataclass(frozen=True)
class Slot:
    """One staged tensor: where it sits in the area. Picklable and small, unlike the tensor."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class StagingArea:
    """This trainer process's staging memory (module docstring)."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self.size = 0
        # False: the node has too little host memory to page-lock the area (trainer/host_memory.py)
        self.allow_pin = True
        self.staging = "none"  # "pinned", "pageable", or "none" before the first save
        self._mm: mmap.mmap | None = None
        self._base: torch.Tensor | None = None
        self._registered = False
        self._reserving: threading.Thread | None = None

    def reserve(self, nbytes: int, pin: bool) -> None:
        """Make the area ready for a save of `nbytes` in a background thread (module docstring)."""
        self.wait_reserved()

        def run() -> None:
            t = time.perf_counter()
            try:
                self._ensure(nbytes, pin)
                log.info("checkpoint staging area reserved in %.1f s, before the first save", time.perf_counter() - t)
            except Exception as e:  # the first save makes it then, in its stall
                log.warning("checkpoint staging area not reserved ahead (%s: %s); the first save makes it",
                            type(e).__name__, e)

        self._reserving = threading.Thread(target=run, name="rlslurm-ckpt-staging", daemon=True)
        self._reserving.start()

    def wait_reserved(self) -> None:
        """Block until a background reservation (`reserve`) is done."""
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None

    def _ensure(self, nbytes: int, pin: bool) -> None:
        if self._base is not None and nbytes <= self.size and (self._registered or not pin):
            return
        self._release()
        size = max(GROW, -(-nbytes // GROW) * GROW)
        fd = os.memfd_create("rlslurm-ckpt-staging")
        try:
            os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self.fd, self.size = fd, size
        self._base = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.staging = "pageable"
        if pin and self.allow_pin:
            err = torch.cuda.cudart().cudaHostRegister(self._base.data_ptr(), size, 0)
            if int(err) == 0:
                self._registered, self.staging = True, "pinned"
            else:
                log.warning("CHECKPOINT STAGING NOT PAGE-LOCKED: cudaHostRegister of %.1f GiB failed (%s); "
                            "every save's copy off the GPU runs at pageable speed (docs/checkpoints.md, "
                            "\"The staging area\")", size / 2**30, err)
        log.info("checkpoint staging area: %.1f GiB of host memory, %s, kept for the run", size / 2**30,
                 self.staging)

    def stage(self, tensors: list[torch.Tensor]) -> list[Slot]:
        """Copy `tensors` into the area; returns where each landed. Blocks until every copy is done."""
        self.wait_reserved()
        pin = self.allow_pin and any(t.device.type == "cuda" for t in tensors) and torch.cuda.is_available()
        offsets, total = [], 0
        for t in tensors:
            offsets.append(total)
            total += _aligned(_nbytes(t))
        self._ensure(total, pin)
        assert self._base is not None
        slots = []
        for t, off in zip(tensors, offsets):
            slot = Slot(off, t.dtype, tuple(t.shape))
            if slot.numel:
                dst = self._base[off:off + _nbytes(t)].view(t.dtype).view(t.shape)
                dst.copy_(t.detach(), non_blocking=self._registered)
            slots.append(slot)
        if pin:
            torch.cuda.synchronize()
        return slots

    def close(self) -> None:
        self.wait_reserved()
        self._release()

    def _release(self) -> None:
        if self._registered and self._base is not None:
            torch.cuda.cudart().cudaHostUnregister(self._base.data_ptr())
        self._registered = False
        self._base = None
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.size = 0


def open_slots(fd: int, size: int, slots: list[Slot]) -> list[torch.Tensor]:
    """In the writer: the staged tensors, read from a mapping of its own of the area's descriptor."""
    mm = mmap.mmap(fd, size)
    return [torch.frombuffer(mm, dtype=s.dtype, count=s.numel, offset=s.offset).view(s.shape) if s.numel
            else torch.empty(s.shape, dtype=s.dtype) for s in slots]


_AREA: StagingArea | None = None


def area() -> StagingArea:
    """This trainer process's one staging area, made at first use (module docstring)."""
    global _AREA
    if _AREA is None:
        _AREA = StagingArea()
    return _AREA
