"""A block-wise FP8 --hf-checkpoint end to end on GPUs (docs/low-precision.md, "Block-wise FP8 checkpoints": the engine
side needs a GPU run): the engine serves tests/helpers/fp8_ckpt.py's tiny FP8 Qwen3 (SGLang's Fp8LinearMethod,
--quantization fp8), the trainer trains it in bf16, and every weight sync sends FP8 weights with their 128x128 scale
blocks. Asserted: the run finishes, every version reaches the engine by the transport (no disk fallback),
the engine reports each version, and rollout vs train log-probs stay within a bound (one e4m3
rounding apart, plus bf16). Not run on CPU: SGLang's FP8 GEMMs need a GPU."""

from __future__ import annotations

from pathlib import Path

from tests.gpu.demo_runs import rlslurm_run, transport, where
from tests.gpu.run_checks import finish, logprob_diffs, logs, metrics, probes
from tests.helpers.deliveries import assert_delivered_by
from tests.helpers.fp8_ckpt import make_fp8_checkpoint


def test_fp8_checkpoint_serves_and_syncs_fp8(tmp_path: Path) -> None:
    n = 6
    yaml, _, fp8 = make_fp8_checkpoint(tmp_path)
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    proc = rlslurm_run(run_dir, log, n, "--model", str(yaml), "--hf-checkpoint", str(fp8), "--bf16",
                       "--rollout-dtype", "bfloat16")
    assert finish(proc, run_dir, log, 600) == 0, logs(run_dir, log)
    engine_logs = "".join(p.read_text(errors="replace") for p in run_dir.rglob("engine-*.log"))
    assert "quantization='fp8'" in engine_logs, "the engine did not start with --quantization fp8"
    assert_delivered_by(run_dir, transport(), versions=set(range(1, n + 1)))
    recs = probes(run_dir)
    assert recs and all(all(str(e.get("weight_version")) == str(r["version"]) for e in r["engines"].values())
                        for r in recs), recs[:2]
    diffs = logprob_diffs(metrics(run_dir))
    assert diffs and max(diffs) < 0.5, diffs
    print(f"GPU FP8 checkpoint ({where()}): {n} versions synced as FP8 blocks; max |train - rollout logprob| "
          f"{max(diffs):.4f}; greedy equal in {sum(r['match'] for r in recs)}/{len(recs)} probes")
