"""What every collective on the trainer's process groups must respect.

* The tensor's device: NCCL moves CUDA tensors only (a CPU tensor fails with "No backend type
  associated with device type cpu"), gloo moves CPU tensors. Every small control tensor (flags,
  counts, agreements) is created on `collective_device()`, never on the CPU by default: the first
  GPU run crashed at its first checkpoint save on exactly that (docs/gpu.md).
* The timeout: torch's default for NCCL is 10 minutes, but rank 0 alone can spend longer than that
  while the other ranks wait in a collective (waiting for engines and the weight-sync prologue are
  bounded by --weight-sync-timeout-s each, a checkpoint on slow storage takes what it takes). Every
  group gets `--distributed-timeout-minutes` (Megatron's name), which `resolve` checks against those
  bounds (`resolve.min_distributed_timeout_s`).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device a tensor must live on for a collective on `group` (default: the world group)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_timeout(minutes: float) -> timedelta:
    return timedelta(minutes=minutes)
