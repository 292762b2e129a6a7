"""The GPU tier (docs/gpu.md): runs only on a machine with a CUDA GPU, and the tests that start engines
only with a supported SGLang and its router; everywhere else (CI included) every test here is skipped
with the reason. With 2+ GPUs the trainer and the engine get one each (NCCL weight sync); with one,
they share it (--shared-gpu, gloo)."""

from __future__ import annotations

import importlib.util

import pytest

from rlslurm.engines.sglang_versions import SUPPORTED, installed_sglang_version

# the files that start real SGLang engines; the others need a GPU and megatron-core only (the
# bundle's part 2 alone: tools/gpu/stage.sh .gpu-bundle/p2)
NEEDS_SGLANG = ("test_gpu_grpo.py", "test_colocate_faults.py", "test_colocate_defaults.py", "test_colocate_families.py",
                "test_engine_span.py", "test_layouts.py", "test_submit_slurm.py", "test_colocate_te.py",
                "test_fp8_checkpoint.py", "test_int4_checkpoint.py")


def _why_not(needs_sglang: bool) -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        return "the GPU tier needs a CUDA GPU"
    if not needs_sglang:
        return None
    version = installed_sglang_version()
    if version not in SUPPORTED:
        return f"SGLang {version} is not a supported version ({', '.join(SUPPORTED)}); see docs/gpu.md"
    if importlib.util.find_spec("sglang_router") is None:
        return "sglang-router is not installed"
    return None


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        path = str(item.fspath).replace("\\", "/")
        if "tests/gpu/" not in path:
            continue
        why = _why_not(needs_sglang=path.rsplit("/", 1)[-1] in NEEDS_SGLANG)
        if why is not None:
            item.add_marker(pytest.mark.skip(reason=f"GPU tier: {why}"))
