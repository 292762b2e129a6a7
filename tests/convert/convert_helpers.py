"""Helpers for tests/convert (a uniquely named module: several conftest.py files share sys.path)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rlslurm.net import free_port

REPO = Path(__file__).resolve().parents[2]
FAMILIES = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-glm4", "tiny-qwen3-moe", "tiny-deepseek-v3",
            "tiny-moonlight", "tiny-glm4-moe", "tiny-glm4-moe-lite", "tiny-mimo", "tiny-minimax-m2", "tiny-qwen3-next",
            "tiny-qwen3.5", "tiny-qwen3.5-moe"]
# Checkpoint tensors a family's mapping leaves alone by design: MiMo's MTP layer (rlslurm.tiny writes
# one, 16 tensors), Qwen3-Next's (5 `mtp.*` tensors) and Qwen3.5's vision tower (21 `model.visual.*`
# tensors), which the trainer never reads and the export never writes.
UNMAPPED = {"tiny-mimo": ("model.mtp_layers.", 16), "tiny-qwen3-next": ("mtp.", 5),
            "tiny-qwen3.5": ("model.visual.", 21), "tiny-qwen3.5-moe": ("model.visual.", 21)}


def mapped(model: str, names) -> set[str]:
    """`names` without the tensors the model's mapping leaves alone (UNMAPPED)."""
    prefix = UNMAPPED.get(model, (None, 0))[0]
    return {n for n in names if prefix is None or not n.startswith(prefix)}


def run_procs(nproc: int, args: list[str], *, timeout: float = 240,
              module: bool = False) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node nproc` on a free port; returns the finished process (not checked)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    cmd += (["-m"] if module else []) + args
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS="1", COLUMNS="200")
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def check(proc: subprocess.CompletedProcess) -> None:
    if proc.returncode != 0:
        raise AssertionError(f"rc={proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
                             f"--- stderr\n{proc.stderr[-8000:]}")


def dtype_runs(run_dir: Path, sync: dict) -> list[str]:
    """The dtypes of a sync in its order (the worker's sync_order.json), one entry per run of equal dtype: a
    flattened bucket holds one dtype (group.iter_buckets), so few runs mean few buckets split by dtype."""
    import json

    dtypes = [str(sync[n].dtype) for n in json.loads((run_dir / "sync_order.json").read_text())]
    return [d for i, d in enumerate(dtypes) if i == 0 or d != dtypes[i - 1]]


# GLM-5 (glm_moe_dsa): MLA + MoE + DeepSeek sparse attention (rlslurm/models/dsa.py)
FAMILIES.append("tiny-glm-moe-dsa")
