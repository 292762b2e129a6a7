"""--transformer-impl transformer_engine through `rlslurm run`, colocated on one GPU with every other default:
a dense, a MoE and an MLA family (tiny configs, random init, the demo's task), 4 rollouts each. Each trains,
every version reaches its engine by CUDA IPC (the publish reads the TE-built model's weights), no engine
restarts, and the trainer's own log names transformer-engine's layers (a run that fell back to megatron's
local layers would pass the rest). Skipped where transformer-engine is not installed: it is in no
supported stack yet (docs/transformer-engine.md; tools/gpu/build-te-part.sh builds it for the GPU tier)."""

from __future__ import annotations

import importlib.util
import re
import time
from pathlib import Path

import pytest

from tests.gpu.colocated_runs import OOM, colocated, engine_text, gpu_name, restart_causes
from tests.gpu.run_checks import finish, logprob_diffs, logs, metrics
from tests.helpers.deliveries import assert_delivered_by, final_lineage

N = 4
pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                                reason="transformer-engine is not installed")


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-qwen3-moe", "tiny-deepseek-v3"])
def test_family_trains_colocated_with_transformer_engine(model: str, tmp_path: Path) -> None:
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    t0 = time.monotonic()
    # transformer-engine is in no supported stack until a run like this one has passed on it (rlslurm/stacks.py
    # refuses it otherwise, as the GPU tier's first TE run found): the flag a user tries it with
    proc = colocated(run_dir, log, "--demo", "--model", model, "--num-rollout", str(N),
                     "--transformer-impl", "transformer_engine", "--allow-untested-stack")
    assert finish(proc, run_dir, log, 300) == 0, logs(run_dir, log)
    assert final_lineage(run_dir) == list(range(N))
    assert_delivered_by(run_dir, "cuda-ipc")
    assert restart_causes(run_dir) == [] and not OOM.search(engine_text(run_dir)), logs(run_dir, log)
    trainer = "".join(p.read_text(errors="replace") for p in run_dir.glob("logs/attempt-*/trainer-0.log"))
    built = re.search(r"models built, --transformer-impl transformer_engine \(([^)]*)\)", trainer)
    assert built and "linear_proj=TERowParallelLinear" in built.group(1), logs(run_dir, log)
    diffs = logprob_diffs(metrics(run_dir))
    print(f"GPU colocated family {model} with transformer-engine ({gpu_name()}): {N}/{N} rollouts by cuda-ipc, "
          f"no restart, layers {built.group(1)}, |train - rollout logprob| {[round(d, 4) for d in diffs]}, "
          f"{time.monotonic() - t0:.0f} s")
