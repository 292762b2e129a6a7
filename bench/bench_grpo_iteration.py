"""One GRPO iteration on two GPUs through the product, `rlslurm run`: where the time goes.

The trainer (megatron-core, bf16, one rank) on GPU 0, one real SGLang engine behind the real router
on GPU 1, NCCL weight sync, a random-init model of a shipped config (qwen3-1.7B by default), the demo
prompts and reward (token ids only: the random model's ids are outside the demo vocabulary, so the
rewards are 0 and the timings are those of any task with these lengths). Synchronous GRPO: the
driver generates rollout k+1 only with version k+1, so an iteration is

    generate (engine) -> commit -> old-logprob recompute -> actor step -> publish (sync) [-> save]

and the trainer's `time/wait_rollout` is the generate + commit part. Rollout 0 is warm-up (CUDA
caches, the first sync); the figures are medians over the other rollouts, from the run's own
records (metrics.jsonl, rollout_metrics.jsonl), and every --save-interval-th rollout saves a
checkpoint (its seconds reported apart).

Reference, same call, same GPU 0 after the run: bench/bench_trainer.py on the same model shape and
about the same micro-batches (a plain megatron forward+backward+step, nothing RL). The figure is the
product's actor-step tokens/s, the ratio figure/reference; MFU (bench/flops.py) for both.

    python3 bench/bench_grpo_iteration.py --out bench/results/grpo-iteration-h100x2.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from flops import peak_bf16, qwen3_forward_flops_per_token  # noqa: E402

from tests.gpu.bundle_flags import run_flags  # noqa: E402

# the trimmed GPU bundle's engine flags; the engine has its GPUs to itself, so a larger KV pool
ENGINE_FLAGS = run_flags()
# placement flags of `rlslurm run` and GPUs used, per layout: the trainer's GPUs first, the engine's next
LAYOUTS = {
    "tp1": (["--gpus-per-node", "1", "--trainer-procs-per-node", "1"], 1, 2),
    "tp2": (["--gpus-per-node", "2", "--trainer-procs-per-node", "2", "--tensor-model-parallel-size", "2",
             "--rollout-num-gpus-per-engine", "2"], 2, 4),
}


def jsonl(p: Path) -> list[dict]:
    return [json.loads(l) for l in p.read_text().splitlines()] if p.exists() else []


def med(xs: list[float]) -> float:
    return round(statistics.median(xs), 4) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-1.7B")
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="tp1",
                    help="tp1: trainer on GPU 0, one engine on GPU 1; "
                         "tp2: trainer TP2 on GPUs 0-1, one TP2 engine on 2-3")
    ap.add_argument("--recompute", action="store_true", help="full activation recompute in the run and the "
                    "reference (slime's recipe for 4B+ on 80 GB: without it qwen3-4B at TP2 ran out of memory)")
    ap.add_argument("--num-rollout", type=int, default=5)
    ap.add_argument("--save-interval", type=int, default=2)
    ap.add_argument("--rollout-batch-size", type=int, default=32)
    ap.add_argument("--n-samples", type=int, default=8)
    ap.add_argument("--response-len", type=int, default=512)
    ap.add_argument("--work", type=Path, default=Path("/tmp/rlslurm-grpo-iter"))
    ap.add_argument("--no-reference", action="store_true", help="skip bench_trainer.py")
    ap.add_argument("--one-sample-micro-batches", action="store_true",
                    help="--no-use-dynamic-batch-size (micro-batches of one sample: the default before the shipped "
                         "configs turned dynamic batching on)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--run-flag", action="append", default=[],
                    help="one more flag for `rlslurm run` (repeat; e.g. --run-flag=--update-weight-receiver "
                         "--run-flag=rlslurm)")
    ap.add_argument("--from-run", type=Path, default=None,
                    help="report an earlier run's records (metrics.jsonl, rollout_metrics.jsonl in this dir)")
    ap.add_argument("--reference-json", type=Path, default=None, help="a bench_trainer.py line of the same machine")
    ap.add_argument("--gpu-name", default=None, help="with --from-run: the GPU it ran on")
    ap.add_argument("--cpu-smoke", action="store_true", help="check the script: tiny-qwen3 on CPU, no reference")
    a = ap.parse_args()
    if a.cpu_smoke:
        a.model, a.response_len, a.rollout_batch_size, a.n_samples, a.no_reference = "tiny-qwen3", 16, 4, 4, True

    import torch
    from demo_run import checkpoint_and_prompts, run_command, run_logged

    from rlslurm.settings.model_config import load_model_config

    mc = load_model_config(a.model)
    placement, tp, gpus = LAYOUTS[a.layout]
    batch = a.rollout_batch_size * a.n_samples
    ckpt_s = wall = None
    if a.from_run is not None:
        run_dir, gpu = a.from_run, a.gpu_name or "?"
    else:
        assert a.cpu_smoke or torch.cuda.device_count() >= gpus, f"layout {a.layout} needs {gpus} GPUs"
        gpu = "cpu" if a.cpu_smoke else torch.cuda.get_device_name(0)
        t = time.perf_counter()
        ckpt, prompts = checkpoint_and_prompts(a.model, a.work, cpu=a.cpu_smoke)
        ckpt_s = time.perf_counter() - t
        run_dir = a.work / f"run-{int(time.time())}"
        cmd = [*run_command(a.model, ckpt, prompts, run_dir, num_rollout=a.num_rollout, save_interval=a.save_interval,
                            rollout_batch_size=a.rollout_batch_size, n_samples=a.n_samples,
                            response_len=a.response_len),
               *placement,
               *(["--megatron-recompute-granularity", "full", "--megatron-recompute-method", "uniform",
                  "--megatron-recompute-num-layers", "1"] if a.recompute else []),
               *(["--no-use-dynamic-batch-size"] if a.one_sample_micro_batches else []), *a.run_flag,
               *(["--device", "cpu", "--rollout-dtype", "float32"] if a.cpu_smoke else ["--device", "cuda",
                                                                                        *ENGINE_FLAGS])]
        wall = run_logged(cmd, a.work / "run.log")

    train = jsonl(run_dir / "metrics.jsonl")
    roll = {r["rollout_id"]: r for r in jsonl(run_dir / "rollout_metrics.jsonl") if r.get("kind") == "train"}
    steady = [r for r in train if r["rollout_id"] >= 1]
    saving = [r for r in steady if (r["rollout_id"] + 1) % a.save_interval == 0]
    iters = [b["time"] - p["time"] for p, b in zip(train, train[1:]) if b["rollout_id"] >= 1]
    tokens = med([r["tokens"] for r in steady])
    seq = statistics.mean(r["response_length_mean"] for r in steady) + 3  # demo prompts: 3 tokens
    fwd = qwen3_forward_flops_per_token(mc.arch, seq)
    peak = peak_bf16(gpu)
    step_s = med([r["time/actor_step"] for r in steady])
    recompute_s = med([r["time/old_logprob"] for r in steady])
    transports = sorted({r.get("weight_sync/transport") for r in train} - {None})
    res = {
        "bench": "grpo_iteration_rlslurm_run",
        "figure": round(tokens / step_s, 1),
        "figure_name": f"actor step tokens/s inside `rlslurm run` (trainer TP{tp}, {tp} GPU(s))",
        "layout": a.layout, "recompute": a.recompute, "weight_sync_transports": transports,
        "weight_sync_fallbacks": max([r.get("weight_sync/fallbacks", 0) for r in train] or [0]),
        "phases_s": {
            "iteration": med(iters),
            "generate": med([roll[r["rollout_id"]]["rollout/time/generate_s"]
                             for r in steady if r["rollout_id"] in roll]),
            "commit": med([roll[r["rollout_id"]]["rollout/time/commit_s"] for r in steady if r["rollout_id"] in roll]),
            "trainer_wait_rollout": med([r["time/wait_rollout"] for r in steady]),
            "old_logprob": recompute_s,
            "actor_step": step_s,
            "publish": med([r["time/publish"] for r in steady]),
            "save": med([r["time/save"] for r in saving]),
        },
        "generate_tokens_per_s": med([roll[i]["rollout/tokens_per_s"] for i in roll if i >= 1]),
        "samples": batch, "train_tokens": tokens,
        "micro_batches": ("one sample each" if a.one_sample_micro_batches
                          else "dynamic, max_tokens_per_gpu of the config"),
        "mean_seq": round(seq, 1),
        "mfu_actor_step": round(3 * fwd * tokens / step_s / peak / tp, 4) if peak else None,
        "mfu_old_logprob": round(fwd * tokens / recompute_s / peak / tp, 4) if peak else None,
        "model": f"{a.model} config, random init, bf16", "gpu": gpu, "gpus": gpus, "run_dir": str(run_dir),
        "torch": None if a.from_run else torch.__version__,
        "checkpoint_write_s": ckpt_s and round(ckpt_s, 1), "run_wall_s": wall and round(wall, 1),
        "num_rollout": a.num_rollout,
        "response_len_max": a.response_len,
    }
    if a.reference_json is not None:
        ref = json.loads(a.reference_json.read_text())
    elif not a.no_reference:  # plain megatron on the same shape and micro-batches, GPU 0, same call
        ref_out = a.work / "trainer-ref.json"
        mbs = max(d for d in range(1, batch + 1) if batch % d == 0 and d * round(seq) <= 9216)  # max_tokens_per_gpu
        launch = [sys.executable] if tp == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                   "--nproc-per-node", str(tp)]
        subprocess.run([*launch, str(ROOT / "bench/bench_trainer.py"), "--model", a.model, "--tp", str(tp),
                        "--samples", str(batch), "--seq", str(int(round(seq))), "--prompt", "3", "--mbs", str(mbs),
                        "--iters", "3", "--warmup", "1", "--out", str(ref_out),
                        *(["--recompute"] if a.recompute else [])], check=True, cwd=ROOT,
                       env=dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(str(i) for i in range(tp))))
        ref = json.loads(ref_out.read_text())
    if a.reference_json is not None or not a.no_reference:
        where = "given" if a.reference_json is not None else "same call"
        res.update({
            "reference": ref["reference"],
            "reference_name": "plain megatron forward+backward+step tokens/s "
                              f"(bench_trainer.py, same shape, TP{tp} on GPUs 0-{tp - 1}, {where})",
            "reference_torch": ref.get("torch"), "reference_gpu": ref.get("gpu"),
            "ratio": round(res["figure"] / ref["reference"], 4),
            "bench_trainer_rl_vs_plain": ref["ratio"],
            "mfu_plain": round(3 * fwd * ref["reference"] / peak / tp, 4) if peak else None,
        })
    line = json.dumps(res)
    print(line, flush=True)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        with a.out.open("a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
