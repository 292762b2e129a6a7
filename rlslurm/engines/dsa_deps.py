"""What an engine of a sparse-attention (DSA) model needs on CUDA beyond SGLang itself: the module
`deep_gemm` (package sgl-deep-gemm). SGLang's DSA indexer imports it on CUDA and its absence is caught
(`deep_gemm = e`), so the engine dies only when the indexer is built ("'ModuleNotFoundError' object
has no attribute 'get_num_sms'" with 0.5.14), after a queue wait and on every requeue. Refused in one
line instead, where the engines' environment is known: the rollout node before it starts them
(rollout/node.py engine_specs) and at submit / `rlslurm run` when the job runs this host's
environment (preflight.py check_dsa_engine). docs/model-families.md, "What SGLang 0.5.14 serves on a
GPU". No torch here (the CLI imports it)."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Callable

from rlslurm.stacks import same_release

if TYPE_CHECKING:
    from rlslurm.settings.model_config import ModelConfig

MODULE, PACKAGE = "deep_gemm", "sgl-deep-gemm"
# SGLang releases whose DSA indexer needs deep_gemm on CUDA: 0.5.14 calls deep_gemm.get_num_sms() in
# Indexer.__init__ (layers/attention/dsa/dsa_indexer.py); 0.5.23 through dsa/utils.py resolve_num_sms
# and the paged-MQA logits (deep_gemm unless SGLANG_FP8_PAGED_MQA_LOGITS_TORCH, a fallback not tried here)
NEEDS_IT = ("0.5.14", "0.5.23")


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that fails, or a module without a spec
        return False


def applies(device: str, sglang_version: str | None) -> bool:
    """Whether engines on `device` with this SGLang need deep_gemm for a sparse-attention model."""
    return device == "cuda" and sglang_version is not None and any(same_release(sglang_version, v)
                                                                    for v in NEEDS_IT)


def dsa_engine_refusal(mc: "ModelConfig | None", device: str, sglang_version: str | None, *,
                       installed: Callable[[str], bool] = _installed) -> str | None:
    """Why engines of `mc` on `device` with SGLang `sglang_version` cannot start in this environment,
    or None. `installed(module)`: whether the engines' Python finds a module."""
    if mc is None or mc.arch.dsa is None or not applies(device, sglang_version) or installed(MODULE):
        return None
    return (f"{mc.name} on --device cuda: SGLang {sglang_version}'s sparse-attention indexer needs the module "
            f"{MODULE}, which this environment does not have; install the package {PACKAGE} "
            f"(SGLang's own requirement, constraints/gpu-torch211.txt pins it) where the rollout runs")
