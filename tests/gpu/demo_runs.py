"""`rlslurm run --demo` on GPUs for the GPU tier's tests (test_gpu_grpo.py, test_fp8_checkpoint.py): the
command, where the trainer and the engine go, and the check that each attempt put them there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.gpu.bundle_flags import run_flags

SGLANG_GPU_FLAGS = run_flags()  # the bundle's backends only: the memory share is the default
SAVE_INTERVAL = 4


def placement() -> list[str]:
    """Trainer and engine on GPUs of their own where there are two, else both on the one."""
    import torch

    return [] if torch.cuda.device_count() >= 2 else ["--shared-gpu"]


def where() -> str:
    return "one shared GPU, gloo weight sync" if placement() else "trainer and engine on GPUs of their own, NCCL"


def transport() -> str:
    return "gloo" if placement() else "nccl"


def check_placement(run_dir: Path) -> None:
    """Each attempt's trainer and engine on the GPUs the placement gives them (issue 30: the first attempt
    had put both on GPU 0): the trainer ranks' GPUs (from torch) and the engines' (engines.json) are
    disjoint unless they share on purpose."""
    from rlslurm.buffer.control import Control
    from rlslurm.buffer.rundir import RunDir

    for attempt in sorted(run_dir.glob("logs/attempt-*")):
        trainer = {json.loads(p.read_text())["gpu_uuid"] for p in attempt.glob("env-trainer-*.json")}
        rollout = [json.loads(p.read_text()) for p in attempt.glob("env-rollout-*.json")]
        assert trainer and None not in trainer and rollout and all(r["gpu_uuids"] for r in rollout), attempt
        if not placement():
            # the rollout's own GPUs come first in its CUDA_VISIBLE_DEVICES: its engine's device 0 is gpu_uuids[0]
            assert not trainer & {r["gpu_uuids"][0] for r in rollout}, (attempt.name, trainer, rollout)
    engines = {u for e in Control(RunDir(run_dir)).engines() for u in e.gpu_uuids}
    assert engines and (placement() or not engines & trainer), (engines, trainer)


def rlslurm_run(run_dir: Path, log: Path, num_rollout: int, *extra: str, gpus: int = 1,
                layout: list[str] | None = None) -> subprocess.Popen:
    """`layout`: the placement flags (default: `placement()`)."""
    # no disk fallback: a sync that fails fails the run, so the transport each test asserts is what ran
    cmd = [sys.executable, "-m", "rlslurm.cli", "run", "--demo", "--run-dir", str(run_dir), "--no-progress",
           "--device", "cuda", "--gpus-per-node", str(gpus), "--trainer-procs-per-node", str(gpus),
           "--num-rollout", str(num_rollout), "--save-interval", str(SAVE_INTERVAL), "--verify-weight-sync",
           "--weight-sync-fallback", "off", *SGLANG_GPU_FLAGS, *(placement() if layout is None else layout), *extra]
    return subprocess.Popen(cmd, stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
