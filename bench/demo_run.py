"""What the `rlslurm run` benches share (bench_grpo_iteration.py, bench_colocate.py): a random-init
checkpoint of a shipped model config, the demo prompts and reward, the run's command, and running it
with its log. The demo reward reads token ids only: on a random model's ids the rewards are 0 and the
timings are those of any task with these lengths."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def checkpoint_and_prompts(model: str, work: Path, *, cpu: bool) -> tuple[Path, Path]:
    """A random-init HF checkpoint of `model` (bf16 on the GPU; kept in `work` across calls) and 256 demo prompts."""
    from rlslurm.demo_task import make_prompts
    from rlslurm.settings.model_config import load_model_config
    from rlslurm.tiny import make_tiny_checkpoint

    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / f"hf-{model}"
    if not (ckpt / "config.json").exists():
        # In a child process: built here, the model's memory stays on the GPU (torch's cache, this
        # process's context) through the whole run the bench measures. It did: 8.3 GiB of qwen3-1.7B
        # held by the bench itself, read as the released engine's residual (docs/colocate.md).
        child = multiprocessing.get_context("spawn").Process(
            target=make_tiny_checkpoint, args=(load_model_config(model), ckpt),
            kwargs={} if cpu else {"dtype": "bfloat16", "device": "cuda"})
        child.start()
        child.join()
        if child.exitcode != 0:
            raise SystemExit(f"building the random-init checkpoint {ckpt} failed (exit {child.exitcode})")
    return ckpt, make_prompts(work / "prompts.jsonl", n=256)


def run_command(model: str, ckpt: Path, prompts: Path, run_dir: Path, *, num_rollout: int, save_interval: int,
                rollout_batch_size: int, n_samples: int, response_len: int) -> list[str]:
    """`rlslurm run` of synchronous GRPO on the demo task, one optimizer step per rollout; device and
    placement flags are the caller's."""
    return [sys.executable, "-m", "rlslurm.cli", "run", "--model", model, "--hf-checkpoint", str(ckpt),
            "--prompt-data", str(prompts), "--run-dir", str(run_dir), "--no-progress",
            "--num-rollout", str(num_rollout), "--save-interval", str(save_interval),
            "--custom-rm-path", "rlslurm.demo_task:reward", "--rollout-temperature", "1.0",
            "--rollout-max-response-len", str(response_len), "--rollout-batch-size", str(rollout_batch_size),
            "--n-samples-per-prompt", str(n_samples), "--global-batch-size", str(rollout_batch_size * n_samples),
            "--num-steps-per-rollout", "1", "--num-epoch", "100"]


def run_logged(cmd: list[str], log: Path) -> float:
    """Run `cmd` from the checkout with its output in `log`; its wall seconds, or exit with the log's tail."""
    t = time.perf_counter()
    with open(log, "wb") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    wall = time.perf_counter() - t
    if rc != 0:
        sys.stderr.write(log.read_text(errors="replace")[-6000:])
        raise SystemExit(f"rlslurm run failed (rc={rc}); log {log}")
    return wall
