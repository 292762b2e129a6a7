"""Where this rank sits: TP/EP/ETP ranks and groups, its part in an export, and the model's layer
numbering.

Read from megatron's `parallel_state` when it is initialised; a plain single-process view
otherwise (the converter's TP=1 path and unit tests without torch.distributed).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class Ranks:
    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1
    tp_group: Any = None
    ep_group: Any = None
    etp_group: Any = None

    @classmethod
    def current(cls) -> "Ranks":
        from megatron.core import parallel_state as ps

        if not (torch.distributed.is_available() and torch.distributed.is_initialized()
                and ps.model_parallel_is_initialized()):
            return cls()
        return cls(
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            ep_size=ps.get_expert_model_parallel_world_size(),
            etp_rank=ps.get_expert_tensor_parallel_rank(),
            etp_size=ps.get_expert_tensor_parallel_world_size(),
            tp_group=ps.get_tensor_model_parallel_group(),
            ep_group=ps.get_expert_model_parallel_group(),
            etp_group=ps.get_expert_tensor_parallel_group(),
        )


@dataclasses.dataclass(frozen=True)
class ExportRoles:
    """A rank's part in an HF export of its pipeline stage (`mcore_to_hf`)."""
    exporter: bool  # iterates the export: every gather it makes needs all of its members
    sender: bool    # the stage's one rank that keeps the full tensors (DP 0, TP 0, so EP 0 and ETP 0)


def export_roles() -> ExportRoles:
    """Who exports: the first dense DP ranks of each stage that the gathers reach
    (rlslurm/settings/parallel_grid.py `exporting_dp_ranks`: DP 0 alone when ETP x EP divides TP, the first
    EP ones at ETP = TP). One process without megatron's parallel state: both."""
    from megatron.core import parallel_state as ps

    from rlslurm.settings.parallel_grid import exporting_dp_ranks

    if not (torch.distributed.is_available() and torch.distributed.is_initialized()
            and ps.model_parallel_is_initialized()):
        return ExportRoles(True, True)
    dp = ps.get_data_parallel_rank()
    first = exporting_dp_ranks(tp=ps.get_tensor_model_parallel_world_size(), cp=ps.get_context_parallel_world_size(),
                               ep=ps.get_expert_model_parallel_world_size(),
                               etp=ps.get_expert_tensor_parallel_world_size())
    return ExportRoles(exporter=dp < first,
                       sender=dp == 0 and ps.get_tensor_model_parallel_rank() == 0
                       and ps.get_context_parallel_rank() == 0)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def layer_numbers(model: torch.nn.Module) -> dict[int, int]:
    """Stage-local layer index -> global 0-based layer index (megatron's layer_number is 1-based)."""
    decoder = getattr(unwrap(model), "decoder", None)
    if decoder is None:
        return {}
    return {i: int(layer.layer_number) - 1 for i, layer in enumerate(decoder.layers)}


def num_local_experts(model: torch.nn.Module) -> int:
    for name, _ in unwrap(model).named_parameters():
        if ".local_experts." in name:
            return 1 + max(int(n.split(".local_experts.")[1].split(".")[0])
                           for n, _ in unwrap(model).named_parameters() if ".local_experts." in n)
    return 0


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by state-dict name (no `_extra_state`)."""
    sd = unwrap(model).state_dict(keep_vars=True)
    return {k: v for k, v in sd.items() if not k.endswith("_extra_state") and isinstance(v, torch.Tensor)}


def partition_dim(t: torch.Tensor) -> int | None:
    """The dim megatron split this tensor along over TP, None when it is replicated."""
    if getattr(t, "tensor_model_parallel", False):
        return int(getattr(t, "partition_dim", 0))
    return None


def is_expert(name: str) -> bool:
    return ".local_experts." in name
