"""Every model family rlslurm lists, colocated on one GPU with the defaults, on the GPU stack (SGLang 0.5.14,
megatron-core 0.19.2): one GRPO run of 4 rollouts each, from the family's tiny config as the demo builds it
(random init, the demo's task). Each trains, and every version reaches its engine by CUDA IPC; no engine
restarts; a family whose engines need a module the environment lacks (GLM-5's indexer: deep_gemm, which the
trimmed bundle leaves out) is refused by `rlslurm run` in one line instead. Before: of six families tried,
only qwen3 trained (the trainer's model build failed on megatron-core 0.19.2 for qwen3-next and glm-moe-dsa;
the engine died on tiny-qwen3-moe's head size and tiny-deepseek-v3's config; tiny-glm4-moe's first sync
stalled)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from rlslurm.settings.model_config import available_models, load_model_config
from tests.gpu.colocated_runs import OOM, colocated, engine_text, gpu_name, restart_causes, shares
from tests.gpu.run_checks import finish, logs
from tests.helpers.deliveries import assert_delivered_by, final_lineage

N = 4


def families() -> dict[str, str]:
    """One tiny config per HF model type (a family), the first by name."""
    out: dict[str, str] = {}
    for name in available_models():
        mc = load_model_config(name)
        if mc.tiny:
            out.setdefault(mc.hf_model_type, name)
    return out


def refused_for_its_engine_modules(model: str) -> bool:
    """A family whose engines need a module this environment lacks: SGLang's DSA indexer imports deep_gemm
    (sgl-deep-gemm, an SGLang requirement the trimmed GPU bundle leaves out: tools/gpu/build-bundle.sh)."""
    from rlslurm.engines.dsa_deps import dsa_engine_refusal
    from rlslurm.engines.sglang_versions import installed_sglang_version

    return dsa_engine_refusal(load_model_config(model), "cuda", installed_sglang_version()) is not None


@pytest.mark.parametrize("model", sorted(families().values()))
def test_family_trains_colocated_with_defaults(model: str, tmp_path: Path) -> None:
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    t0 = time.monotonic()
    proc = colocated(run_dir, log, "--demo", "--model", model, "--num-rollout", str(N))
    if refused_for_its_engine_modules(model):
        from rlslurm.engines.dsa_deps import MODULE, PACKAGE

        # refused before any process starts: the CLI's exit for a UserError (rlslurm/cli.py main), one line
        assert finish(proc, run_dir, log, 120) == 2, logs(run_dir, log)
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if f"module {MODULE}" in ln]
        assert len(lines) == 1 and lines[0].startswith("error: ") and model in lines[0] and PACKAGE in lines[0], \
            logs(run_dir, log)
        assert not (run_dir / "run.yaml").exists()
        print(f"GPU colocated family {model} ({gpu_name()}): refused, {lines[0]}")
        return
    assert finish(proc, run_dir, log, 300) == 0, logs(run_dir, log)
    assert final_lineage(run_dir) == list(range(N))
    assert_delivered_by(run_dir, "cuda-ipc")
    assert restart_causes(run_dir) == [] and not OOM.search(engine_text(run_dir)), logs(run_dir, log)
    [s] = shares(run_dir)
    assert s["derived"]
    print(f"GPU colocated family {model} ({gpu_name()}): {N}/{N} rollouts, every version by cuda-ipc, no restart, "
          f"share {s['fraction']:.3f} (SGLang's default {s['sglang_default']}), {time.monotonic() - t0:.0f} s")
