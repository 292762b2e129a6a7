"""One process, one GPU (run by test_cpu_offload.py): the real trainer setup (megatron-core,
tiny-qwen3 in bf16, distributed optimizer) trains rollouts 0..N-1 of a fixed synthetic stream,
optionally with megatron's CPU optimizer offload, saving or loading rlslurm's checkpoint after
`--save-at` / from `--load`, and writes the final weights (HF names) to `--out`."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import numpy as np
import torch


def rollout(rid: int, vocab: int):
    from rlslurm.buffer import Rollout, RolloutMeta, RolloutStats, Sample

    rng = np.random.default_rng([rid, 7])
    samples = []
    for i in range(8):
        p, r = int(rng.integers(3, 9)), int(rng.integers(4, 17))
        samples.append(Sample(prompt_tokens=rng.integers(4, vocab, p), response_tokens=rng.integers(4, vocab, r),
                              reward=float(rng.integers(0, 2)), rollout_logprobs=-rng.random(r).astype(np.float32),
                              group_index=i // 4, index=i))
    return Rollout(rollout_id=rid, samples=samples, meta=RolloutMeta(), stats=RolloutStats.of(samples))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--offload", action="store_true")
    ap.add_argument("--rollouts", type=int, default=4)
    ap.add_argument("--save-at", type=int, default=None)
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--load", action="store_true")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda", help="cpu: check this script without offload")
    ap.add_argument("--clip-grad", type=float, default=1.0)
    a = ap.parse_args()
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(29500 + os.getpid() % 1000)), ("RANK", "0"),
                 ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)
    from rlslurm.buffer.progress import TrainerProgress
    from rlslurm.config import RunConfig
    from rlslurm.convert import mcore_to_hf
    from rlslurm.trainer import checkpoint
    from rlslurm.trainer import step as steps
    from rlslurm.trainer.setup import build_trainer, init_distributed

    init_distributed(a.device, timeout_minutes=5)
    megatron = {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.0} if a.offload else {}
    cfg = RunConfig.model_validate({
        "run": {"run_dir": tempfile.mkdtemp(), "device": a.device, "seed": 3},
        "model": {"model": "tiny-qwen3"},
        "rollout": {"num_rollout": max(1, a.rollouts), "rollout_batch_size": 2, "n_samples_per_prompt": 4},
        "train": {"micro_batch_size": 2, "global_batch_size": 4, "num_steps_per_rollout": 2, "lr": 1e-2,
                  "bf16": True, "use_distributed_optimizer": True, "clip_grad": a.clip_grad, "adam_eps": 1e-3},
        "megatron": megatron,
    })
    st = build_trainer(cfg, 1)
    progress = checkpoint.load(st, checkpoint.find_resume(a.ckpt)) if a.load else TrainerProgress()
    for rid in range(progress.next_rollout_id, a.rollouts):
        r = rollout(rid, 64)
        prep = steps.prepare(st, r)
        for k in range(2):
            steps.train_step(st, r, prep, k)
        progress.record_trained(r)
        if a.save_at is not None and progress.trained_rollouts == a.save_at:
            checkpoint.save(st, progress, a.ckpt, keep=2)
    torch.save({n: t.float().cpu() for n, t in mcore_to_hf(st.mc, st.actor.model)}, a.out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
