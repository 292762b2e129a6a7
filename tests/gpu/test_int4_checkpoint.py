"""An INT4 W4A16 compressed-tensors --hf-checkpoint end to end on GPUs (docs/low-precision.md, "INT4
W4A16 checkpoints": the engine side needs a GPU run), the INT4 twin of test_fp8_checkpoint.py: the
engine serves tests/helpers/int4_ckpt.py's tiny INT4 Qwen3-MoE (SGLang's CompressedTensorsWNA16MoE, Marlin,
--moe-runner-backend marlin), the trainer trains it in bf16, and every weight sync sends the experts
as weight_packed/weight_scale/weight_shape in groups of 128.

Under SGLang 0.5.23 (the weight-update session) asserted: the run finishes, every version reaches the
engine by the transport (no disk fallback), the engine reports each version, and rollout vs train
log-probs stay within a bound (one int4 rounding apart, plus bf16). Under 0.5.14 (the GPU machines'
version) asserted instead: the engine is refused at start with the one-line reason, before it serves.
Not run on CPU: SGLang's Marlin kernels need a GPU."""

from __future__ import annotations

from pathlib import Path

from rlslurm.engines.sglang_versions import api_for, installed_sglang_version
from tests.gpu.demo_runs import rlslurm_run, transport, where
from tests.gpu.run_checks import finish, logprob_diffs, logs, metrics, probes
from tests.helpers.deliveries import assert_delivered_by
from tests.helpers.int4_ckpt import make_int4_checkpoint, model_yaml


def test_int4_checkpoint_serves_and_syncs_int4(tmp_path: Path) -> None:
    n = 6
    yaml = model_yaml(tmp_path)
    _, int4 = make_int4_checkpoint(tmp_path, str(yaml), group=128)
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    proc = rlslurm_run(run_dir, log, n, "--model", str(yaml), "--hf-checkpoint", str(int4), "--bf16",
                       "--rollout-dtype", "bfloat16")
    version = installed_sglang_version()
    if not api_for(version).weight_update_session:  # 0.5.14: refused at the engine's start, one line
        assert finish(proc, run_dir, log, 600) != 0, logs(run_dir, log)
        text = log.read_text(errors="replace") + "".join(
            p.read_text(errors="replace") for p in run_dir.rglob("*.log"))
        assert f"INT4 W4A16 compressed-tensors, and SGLang {version} cannot load a weight update" in text, \
            logs(run_dir, log)
        print(f"GPU INT4 checkpoint ({where()}): SGLang {version} refused at engine start, as documented")
        return
    assert finish(proc, run_dir, log, 600) == 0, logs(run_dir, log)
    engine_logs = "".join(p.read_text(errors="replace") for p in run_dir.rglob("engine-*.log"))
    assert "moe_runner_backend='marlin'" in engine_logs, "the engine did not start with --moe-runner-backend marlin"
    assert "compressed-tensors" in engine_logs or "compressed_tensors" in engine_logs, "the engine is not INT4"
    assert_delivered_by(run_dir, transport(), versions=set(range(1, n + 1)))
    recs = probes(run_dir)
    assert recs and all(all(str(e.get("weight_version")) == str(r["version"]) for e in r["engines"].values())
                        for r in recs), recs[:2]
    diffs = logprob_diffs(metrics(run_dir))
    assert diffs and max(diffs) < 0.5, diffs
    print(f"GPU INT4 checkpoint ({where()}): {n} versions synced as INT4 groups; max |train - rollout logprob| "
          f"{max(diffs):.4f}; greedy equal in {sum(r['match'] for r in recs)}/{len(recs)} probes")
