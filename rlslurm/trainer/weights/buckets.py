"""What both engine transports (broadcast.py, ipc.py) make of a bucket: its layout as rlslurm's
receiver reads it (engines/receiver.py `BucketPlan`), the request entry that carries that layout
through SGLang's /update_weights_from_tensor, and the count of what was sent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlslurm.engines.fanout import dtype_name
from rlslurm.engines.receiver import BucketPlan


@dataclass
class SendStats:
    tensors: int = 0
    buckets: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def count(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        self.buckets += 1
        self.tensors += len(bucket)
        self.bytes += sum(t.numel() * t.element_size() for _, t in bucket)


def bucket_plan(bucket: list[tuple[str, torch.Tensor]]) -> BucketPlan:
    """A one-dtype bucket's layout as flatten_bucket lays it out (rlslurm's receiver plan)."""
    entries, off = [], 0
    for name, t in bucket:
        entries.append((name, tuple(int(x) for x in t.shape), off))
        off += t.numel() * t.element_size()
    return BucketPlan(off, dtype_name(bucket[0][1].dtype), tuple(entries))


class _EmptyTensor:
    """Unpickles as `torch.Tensor()` (empty; one global, torch._tensor.Tensor). A pickled tensor names its storage
    loader, which megatron-core 0.19 replaces in the trainer process (megatron.core.safe_globals.safe_load_from_bytes),
    and SGLang's SafeUnpickler refuses that module: the engine's scheduler dies on it."""

    def __reduce__(self):
        return (torch.Tensor, ())


def serialized_plan(name: str) -> str:
    """One TP rank's `serialized_named_tensors` entry: SGLang unpickles it (its SafeUnpickler allows
    torch.*) into [(name, tensor)]; the plan is the name, the tensor an empty placeholder."""
    import base64
    import pickle

    return base64.b64encode(pickle.dumps([(name, _EmptyTensor())])).decode()
