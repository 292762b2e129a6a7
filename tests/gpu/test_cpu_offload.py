"""megatron-core's CPU optimizer offload (--megatron-optimizer-cpu-offload, slime's recipes use it in
24 of 45 scripts) in rlslurm's trainer, on a GPU (megatron's HybridDeviceOptimizer moves CUDA
parameters to host copies; with no CUDA parameters it has nothing to offload and fails, so the CPU
stack cannot run it). Checked: 4 rollouts (8 optimizer steps) with the optimizer on the CPU give the
weights of the GPU optimizer to bf16 rounding, and a run saved after 2 rollouts and resumed in a new
process gives the straight offloaded run's weights bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("offload_worker.py")
REPO = Path(__file__).resolve().parents[2]


def _worker(tmp: Path, name: str, *args: str) -> dict[str, torch.Tensor]:
    out = tmp / f"{name}.pt"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    p = subprocess.run([sys.executable, str(WORKER), "--out", str(out), *args], capture_output=True, text=True,
                       env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-6000:]
    return torch.load(out)


def test_cpu_offload_steps_like_the_gpu_optimizer_and_resumes_exactly(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("megatron's CPU optimizer offload needs CUDA parameters")
    gpu = _worker(tmp_path, "gpu", "--ckpt", str(tmp_path / "ck-gpu"))
    off = _worker(tmp_path, "offload", "--offload", "--ckpt", str(tmp_path / "ck"), "--save-at", "2")
    resumed = _worker(tmp_path, "resumed", "--offload", "--ckpt", str(tmp_path / "ck"), "--load")
    init = _worker(tmp_path, "init", "--ckpt", str(tmp_path / "ck-init"), "--rollouts", "0")
    assert gpu.keys() == off.keys() == resumed.keys()
    differ = [n for n in off if not torch.equal(off[n], resumed[n])]
    assert not differ, differ  # resume from the offloaded optimizer's checkpoint is exact
    moved = min(float((gpu[n] - init[n]).abs().max()) for n in gpu)
    worst = max(float((gpu[n] - off[n]).abs().max() / gpu[n].abs().max()) for n in gpu)
    assert moved > 0 and worst < 2e-2, (moved, worst)  # bf16 weights: CPU vs GPU AdamW round alike
