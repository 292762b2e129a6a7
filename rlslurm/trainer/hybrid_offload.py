"""megatron-core's CPU optimizer offload (`--megatron-optimizer-cpu-offload`: its HybridDeviceOptimizer)
under the distributed optimizer, made loadable.

With `param_update_in_fp32` (megatron always sets it for the offload) the HybridDeviceOptimizer
keeps an fp32 copy of every parameter that is not fp32, and after each `load_state_dict` copies the
loaded `master_param` into those copies (`_update_fp32_params_by_new_state`). Under the distributed
optimizer its parameters are megatron's fp32 main-parameter shards, which have no copy, and that
method looks every one of them up: KeyError, at rlslurm's first load (the dummy state a resume
loads into, trainer/checkpoint/state.py `_materialize_state`), megatron-core 0.19.2
(tests/gpu/test_cpu_offload.py). Here a parameter without a copy is skipped: there is nothing to
copy into, and its own value is what the checkpoint restores."""

from __future__ import annotations

import types
from typing import Any


def _update_fp32_params_by_new_state(self) -> None:
    if not self.param_update_in_fp32:
        return
    for param, v in self.state.items():
        fp32_param = self.param_to_fp32_param.get(param)
        if fp32_param is not None and "master_param" in v:
            fp32_param.data.copy_(v["master_param"])


def make_loadable(opt: Any) -> int:
    """Patch every HybridDeviceOptimizer inside megatron's optimizer `opt`; how many were found."""
    try:
        from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer
    except ImportError:  # a megatron-core without the CPU offload
        return 0
    found = 0
    for part in getattr(opt, "chained_optimizers", None) or [opt]:
        inner = getattr(part, "optimizer", None)
        if isinstance(inner, HybridDeviceOptimizer):
            inner._update_fp32_params_by_new_state = types.MethodType(_update_fp32_params_by_new_state, inner)
            found += 1
    return found
