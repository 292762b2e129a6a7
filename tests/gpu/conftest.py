"""The GPU tier (docs/gpu.md): runs only on a machine with a CUDA GPU and a supported SGLang with its
router; everywhere else (CI included) every test here is skipped with the reason. With 2+ GPUs the
trainer and the engine get one each (NCCL weight sync); with one, they share it (--shared-gpu, gloo)."""

from __future__ import annotations

import importlib.util

import pytest

from rlslurm.engines.sglang_versions import SUPPORTED, installed_sglang_version


def _why_not() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        return "the GPU tier needs a CUDA GPU"
    version = installed_sglang_version()
    if version not in SUPPORTED:
        return f"SGLang {version} is not a supported version ({', '.join(SUPPORTED)}); see docs/gpu.md"
    if importlib.util.find_spec("sglang_router") is None:
        return "sglang-router is not installed"
    return None


def pytest_collection_modifyitems(config, items) -> None:
    why = _why_not()
    if why is None:
        return
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.skip(reason=f"GPU tier: {why}"))
