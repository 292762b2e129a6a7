"""What every collective on the trainer's process groups must respect.

* The tensor's device: NCCL moves CUDA tensors only (a CPU tensor fails with "No backend type
  associated with device type cpu"), gloo moves CPU tensors. Every small control tensor (flags,
  counts, agreements) is created on `collective_device()`, never on the CPU by default: the first
  GPU run crashed at its first checkpoint save on exactly that (docs/gpu.md).
* Who decides: where rank 0 alone reads the run directory and tells the others (`from_rank0`), an
  error it meets travels with the verdict, so that every rank ends the same way.
* The timeout: torch's default for NCCL is 10 minutes, but rank 0 alone can spend longer than that
  while the other ranks wait in a collective (waiting for engines and the weight-sync prologue are
  bounded by --weight-sync-timeout-s each, a checkpoint on slow storage takes what it takes). Every
  group gets `--distributed-timeout-minutes` (Megatron's name), which `resolve` checks against those
  bounds (`resolve.min_distributed_timeout_s`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Callable, TypeVar

import torch
import torch.distributed as dist


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device a tensor must live on for a collective on `group` (default: the world group)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_timeout(minutes: float) -> timedelta:
    return timedelta(minutes=minutes)


T = TypeVar("T")


def portable_error(e: BaseException) -> BaseException:
    """`e` as it can travel to the other ranks (pickled): itself, or one that names it and keeps what
    decides how a role ends (a StorageError fails the attempt, a UserError ends the job)."""
    import pickle

    from rlslurm.buffer.atomic import StorageError
    from rlslurm.errors import UserError

    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - an exception that does not survive pickling
        text = f"{type(e).__name__}: {e}"
        return StorageError(text) if isinstance(e, StorageError) else \
            UserError(text) if isinstance(e, UserError) else RuntimeError(text)


def from_rank0(rank: int, world: int, fn: Callable[[], T]) -> T:
    """Collective: rank 0's `fn()`, learnt by every rank at the same call. An error rank 0 meets (a
    damaged record, the filesystem failing, bad data) is raised on every rank alike, so every rank ends
    the same way (rlslurm/user_error.py `run_role`) instead of the others waiting in the next
    collective for a rank 0 that is gone."""
    msg: list = [None]
    error: BaseException | None = None
    if rank == 0:
        try:
            msg = [("ok", fn())]
        except Exception as e:  # noqa: BLE001 - every kind travels to every rank
            error = e
            msg = [("error", portable_error(e))]
    if world > 1:
        dist.broadcast_object_list(msg, src=0)
    kind, value = msg[0]
    if kind == "error":
        raise (error or value)
    return value
