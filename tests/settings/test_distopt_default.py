"""--use-distributed-optimizer's default: on whenever the data-parallel size is > 1, on any device
(resume with it is bit-exact: tests/trainer/test_trainer_resume.py); an explicit flag wins."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlslurm.resolve import resolve
from tests.helpers.hf_shape import hf_shaped_dir


@pytest.mark.parametrize("extra, expected", [
    ([], True),                                              # 8 GPUs / TP 2 = DP 4
    (["--tensor-model-parallel-size", "8"], False),          # DP 1: nothing to shard over
    (["--no-use-distributed-optimizer"], False),
    (["--tensor-model-parallel-size", "8", "--use-distributed-optimizer"], True),
])
def test_cuda_default_follows_the_data_parallel_size(prompts: Path, extra: list[str], expected: bool) -> None:
    cfg = resolve(["--model", "qwen3-4B", "--nodes", "2", "--prompt-data", str(prompts), "--hf-checkpoint",
                   str(hf_shaped_dir(prompts.parent / "hf", "qwen3-4B")), *extra]).cfg
    assert cfg.train.use_distributed_optimizer is expected


@pytest.mark.parametrize("procs, expected", [(2, True), (1, False)])
def test_cpu_default_follows_the_data_parallel_size(prompts: Path, procs: int, expected: bool) -> None:
    cfg = resolve(["--model", "tiny-qwen3", "--nodes", "2", "--device", "cpu", "--gpus-per-node", "0",
                   "--trainer-procs-per-node", str(procs), "--prompt-data", str(prompts)]).cfg
    assert cfg.train.use_distributed_optimizer is expected


@pytest.mark.parametrize("extra, error", [
    ([], None),                                               # DP 4: distributed, bf16
    (["--tensor-model-parallel-size", "8"], "needs --use-distributed-optimizer"),
    (["--no-bf16"], "needs --bf16"),
])
def test_cpu_optimizer_offload_needs_the_distributed_optimizer_and_16_bit_weights(
        prompts: Path, extra: list[str], error: str | None) -> None:
    """megatron-core's HybridDeviceOptimizer runs inside the distributed optimizer, on the fp32 main
    copies of 16-bit weights (with fp32 weights it fails: "can't optimize a non-leaf Tensor")."""
    from rlslurm.errors import ConfigError

    argv = ["--model", "qwen3-4B", "--nodes", "2", "--prompt-data", str(prompts), "--hf-checkpoint",
            str(hf_shaped_dir(prompts.parent / "hf", "qwen3-4B")), "--megatron-optimizer-cpu-offload", "true",
            "--megatron-optimizer-offload-fraction", "1.0", *extra]
    if error is None:
        assert resolve(argv).cfg.megatron["optimizer_cpu_offload"] is True
    else:
        with pytest.raises(ConfigError, match=error):
            resolve(argv)
