"""Which kernel steps torch's Adam when megatron-core falls back to it (docs/optimizer-kernel.md).

megatron-core takes transformer-engine's FusedAdam, else Apex's, else torch's AdamW with torch's defaults:
on a GPU that is the multi-tensor ("foreach") step, which computes the denominator of every parameter
at once into a new list of tensors, a scratch copy of all the fp32 main parameters. On rlslurm's GPU
stack (no transformer-engine, no Apex) that scratch is what did not fit: qwen3-4B on one 80 GB H100
reached its first optimizer step with 74.6 GiB allocated and died allocating it, in plain megatron-core
as in rlslurm's RL step and in a colocated run (bench/results/gpu-lease-2026-12-07d.md). torch's fused
kernel updates in place, one launch per group of tensors, as the FusedAdam megatron prefers does, so
rlslurm asks for it wherever torch has one for the parameters' device. Its arithmetic differs from the
foreach step's in the last bits; a run is exact against itself (kill and resume) either way.
"""

from __future__ import annotations

from typing import Any

import torch

from rlslurm.trainer.tensor_sets import torch_optimizers


def _fusable(group: dict[str, Any]) -> bool:
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    devices = _get_fused_kernels_supported_devices()
    return not group.get("differentiable") and all(
        p.is_floating_point() and p.device.type in devices for p in group["params"])


def use_fused_adam(opt: Any) -> int:
    """Switch every param group of torch's Adam/AdamW inside megatron's optimizer `opt` that torch can step
    with its fused kernel to it; again after a load (a checkpoint's param groups bring their own flags),
    with each parameter's `step` where the fused kernel reads it (a float32 tensor on the parameter's
    device). The number of groups that step fused; 0 when megatron took transformer-engine's or Apex's
    FusedAdam, or offloads the optimizer to the CPU (its own classes)."""
    fused = 0
    for o in torch_optimizers(opt):
        if type(o) not in (torch.optim.Adam, torch.optim.AdamW):
            continue
        for group in o.param_groups:
            if not _fusable(group):
                continue
            group["fused"], group["foreach"] = True, False
            fused += 1
            for p in group["params"]:
                state = o.state.get(p)
                if state and isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].to(device=p.device, dtype=torch.float32)
    return fused
