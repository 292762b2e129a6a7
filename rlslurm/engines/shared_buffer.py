"""A byte buffer the trainer writes and an engine on the same node reads in place: how weights reach
a colocated engine without a copy through host memory (trainer/weights/ipc.py writes, engines/receiver.py
reads). A *source* is the JSON-able description that travels in the update request.

- cuda: a CUDA IPC handle of the buffer's allocation (torch's own `reduce_tensor` /
  `rebuild_cuda_tensor`, the path torch.multiprocessing uses for CUDA tensors). The engine opens it on
  the GPU with the same UUID (its device numbering may differ from the trainer's), and waits on the IPC
  event torch records when the handle is taken, so it reads the bytes only once the trainer's copy into
  the buffer is done. docs/colocate.md, "Weights by CUDA IPC".
- cpu: a memfd of the trainer process, mapped by the engine through /proc/<pid>/fd/<fd> (same user,
  same node). Nothing is left behind when the trainer exits, however it exits.

No pickle crosses: the request names fields, and the engine builds the tensor from them.
"""

from __future__ import annotations

import base64
import os
from typing import Any

import torch

# torch.multiprocessing.reductions.reduce_tensor's arguments for rebuild_cuda_tensor (torch 2.11 - 2.13)
_CUDA_ARGS = ("tensor_cls", "size", "stride", "offset", "storage_cls", "dtype", "device", "handle", "storage_nbytes",
              "storage_offset", "requires_grad", "ref_counter_handle", "ref_counter_offset", "event_handle",
              "event_sync_required")


def _b64(b: bytes | None) -> str | None:
    return None if b is None else base64.b64encode(b).decode()


def _unb64(s: str | None) -> bytes | None:
    return None if s is None else base64.b64decode(s)


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def cuda_source(t: torch.Tensor) -> dict[str, Any]:
    """The source of a contiguous uint8 CUDA tensor. Call it after the writes to `t` are enqueued: the
    IPC event is recorded on the current stream now. `t` must stay alive until the engine answered."""
    from torch.multiprocessing.reductions import reduce_tensor

    if t.device.type != "cuda" or t.dtype != torch.uint8 or not t.is_contiguous() or t.dim() != 1:
        raise ValueError(f"cuda_source: a 1-D contiguous uint8 CUDA tensor, got {t.dtype} {tuple(t.shape)} "
                         f"on {t.device}")
    _, args = reduce_tensor(t)
    if len(args) != len(_CUDA_ARGS):
        raise RuntimeError(f"torch {torch.__version__}: reduce_tensor gave {len(args)} arguments, "
                           f"rlslurm knows the {len(_CUDA_ARGS)} of torch 2.11-2.13 (rlslurm/engines/shared_buffer.py)")
    a = dict(zip(_CUDA_ARGS, args))
    return {"kind": "cuda_ipc", "uuid": device_uuid(a["device"]), "nbytes": t.numel(), "offset": int(a["offset"]),
            "handle": _b64(a["handle"]), "storage_nbytes": int(a["storage_nbytes"]),
            "storage_offset": int(a["storage_offset"]), "ref_counter_handle": _b64(a["ref_counter_handle"]),
            "ref_counter_offset": int(a["ref_counter_offset"]), "event_handle": _b64(a["event_handle"]),
            "event_sync_required": bool(a["event_sync_required"])}


class MemfdBuffer:
    """A host buffer in a memfd of this process (the cpu transport)."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.fd = os.memfd_create("rlslurm-weights", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, max(1, nbytes))
        self.tensor = torch.from_file(f"/proc/self/fd/{self.fd}", shared=True, size=nbytes, dtype=torch.uint8)

    def source(self, nbytes: int) -> dict[str, Any]:
        return {"kind": "memfd", "pid": os.getpid(), "fd": self.fd, "nbytes": nbytes}

    def close(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)  # the mapping goes with the last reference
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _local_cuda_index(uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return i
    raise RuntimeError(f"weights by CUDA IPC: the trainer's GPU {uuid} is not visible to this engine "
                       f"({torch.cuda.device_count()} visible); colocated engines must see the trainer's GPUs")


def open_source(src: dict[str, Any]) -> torch.Tensor:
    """The engine's view of a source: a 1-D uint8 tensor of `src['nbytes']` bytes, not a copy."""
    kind = src.get("kind")
    if kind == "memfd":
        return torch.from_file(f"/proc/{int(src['pid'])}/fd/{int(src['fd'])}", shared=True, size=int(src["nbytes"]),
                               dtype=torch.uint8)
    if kind == "cuda_ipc":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        n = int(src["nbytes"])
        return rebuild_cuda_tensor(torch.Tensor, (n,), (1,), int(src["offset"]), torch.UntypedStorage, torch.uint8,
                                   _local_cuda_index(src["uuid"]), _unb64(src["handle"]), int(src["storage_nbytes"]),
                                   int(src["storage_offset"]), False, _unb64(src["ref_counter_handle"]),
                                   int(src["ref_counter_offset"]), _unb64(src["event_handle"]),
                                   bool(src["event_sync_required"]))
    raise ValueError(f"unknown weight source kind {kind!r}")
