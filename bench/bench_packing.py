"""Sequence packing: the RL train step with `--qkv-format thd` vs `bshd` (right-padded), same batch.

A rollout whose response lengths have a long tail (lognormal, as RL responses do, capped at
`--max-response`) is trained with dynamic batching under one `--max-tokens-per-gpu` budget twice,
each in a fresh process with its own trainer (the model spec differs: packed rows need the packed
core attention): padded micro-batches (megatron's local attention, the budget counts n x the
longest sample) and packed ones (samples concatenated, the budget counts real tokens). Both train
the same samples from the same seed; tokens/s counts real tokens only. Prints one JSON line:
figure = packed tokens/s, reference = padded tokens/s, ratio = figure / reference.

    python bench/bench_packing.py                  # GPU, qwen3-1.7B shape
    python bench/bench_packing.py --tiny --cpu     # smoke test of the script
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))


def lengths(n: int, max_response: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    resp = np.minimum(rng.lognormal(np.log(max_response / 8), 1.0, n), max_response).astype(int) + 1
    return [int(r) for r in resp]


def make_rollout(n: int, prompt: int, responses: list[int], vocab: int, seed: int = 0):
    from rlslurm.buffer import Rollout, RolloutMeta, RolloutStats, Sample

    rng = np.random.default_rng(seed)
    samples = [Sample(prompt_tokens=rng.integers(0, vocab, prompt), response_tokens=rng.integers(0, vocab, r),
                      reward=float(rng.integers(0, 2)), rollout_logprobs=-rng.random(r).astype(np.float32),
                      group_index=i // 4, index=i) for i, r in enumerate(responses)]
    return Rollout(rollout_id=0, samples=samples, meta=RolloutMeta(), stats=RolloutStats.of(samples))


def one(a: argparse.Namespace) -> dict:
    """In this process: build the trainer for `a.format`, time `train_step` on the rollout."""
    from bench_trainer import bench_trainer

    from rlslurm.trainer import step as steps

    device = "cpu" if a.cpu else "cuda"
    st, vocab = bench_trainer(tiny=a.tiny, cpu=a.cpu, layers=a.layers, train={
        "global_batch_size": a.samples, "use_dynamic_batch_size": True, "max_tokens_per_gpu": a.max_tokens_per_gpu,
        "qkv_format": a.format})
    responses = lengths(a.samples, a.max_response, a.seed)
    rollout = make_rollout(a.samples, a.prompt, responses, vocab, a.seed)
    prep = steps.prepare(st, rollout)
    if a.dump is not None:  # the old log-probs (same seed, same weights) for the cross-format check
        torch.save({i: t.float().cpu() for i, t in prep.old_logprobs.items()}, a.dump)

    def step() -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        steps.train_step(st, rollout, prep, 0)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    for _ in range(a.warmup):
        step()
    times = [step() for _ in range(a.iters)]
    if a.profile:  # where one step's time goes, to stderr (the parent prints it)
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=acts) as prof:
            step()
        key = "cuda_time_total" if device == "cuda" else "cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=25), file=sys.stderr)
    plan = prep.plan
    lens = [a.prompt + r for r in responses]
    padded_tokens = sum(len(mb) * max(lens[i] for i in mb) for mb in plan.steps[0])
    return {"format": a.format, "step_s": times, "median_s": statistics.median(times),
            "real_tokens": sum(lens), "micro_batches": len(plan.steps[0]),
            "tokens_computed": sum(lens) if a.format == "thd" else padded_tokens,
            "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if device == "cuda" else None,
            "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu"}


def _without_out(argv: list[str]) -> list[str]:
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
        elif x == "--out":
            skip = True
        elif not x.startswith("--out="):
            out.append(x)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--max-response", type=int, default=2048)
    ap.add_argument("--max-tokens-per-gpu", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="tiny-qwen3 in fp32 (script smoke test)")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--format", choices=["bshd", "thd"], help=argparse.SUPPRESS)  # one side, in a child
    ap.add_argument("--profile", action="store_true", help="print each side's top ops of one step")
    ap.add_argument("--dump", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.format is not None:
        print(json.dumps(one(a)), flush=True)
        return
    if a.tiny:
        a.prompt, a.max_response, a.max_tokens_per_gpu = min(a.prompt, 8), min(a.max_response, 48), \
            min(a.max_tokens_per_gpu, 128)
    sides = {}
    tmp = Path(tempfile.mkdtemp())
    for fmt in ("bshd", "thd"):
        argv = [sys.executable, __file__, "--format", fmt, "--dump",
                str(tmp / f"{fmt}.pt")] + _without_out(sys.argv[1:])
        if a.tiny:
            argv += ["--prompt", str(a.prompt), "--max-response", str(a.max_response),
                     "--max-tokens-per-gpu", str(a.max_tokens_per_gpu)]
        p = subprocess.run(argv, capture_output=True, text=True)
        if p.returncode != 0:
            oom = "OutOfMemoryError" in p.stderr
            if not oom or fmt == "thd":
                sys.exit(f"bench_packing: the {fmt} side failed:\n{p.stderr[-4000:]}")
            # the padded side running out of memory where the packed one fits is a result
            sides[fmt] = {"median_s": float("nan"), "real_tokens": 0, "tokens_computed": 0, "micro_batches": None,
                          "step_s": "out of GPU memory", "peak_mem_gib": None}
            continue
        sides[fmt] = json.loads(p.stdout.strip().splitlines()[-1])
        if a.profile:
            print(f"--- {fmt}\n{p.stderr[-12000:]}", file=sys.stderr)
    pad, pk = sides["bshd"], sides["thd"]
    lp_pk = torch.load(tmp / "thd.pt")
    lp_pad = torch.load(tmp / "bshd.pt") if (tmp / "bshd.pt").exists() else lp_pk
    diff = max(float((lp_pad[i] - lp_pk[i]).abs().max()) for i in lp_pad)
    pad["real_tokens"] = pad["real_tokens"] or pk["real_tokens"]
    res = {
        "bench": "trainer_packed_vs_padded",
        "figure": round(pk["real_tokens"] / pk["median_s"], 1),
        "figure_name": "RL train step real tokens/s, --qkv-format thd",
        "reference": round(pad["real_tokens"] / pad["median_s"], 1),
        "reference_name": "the same step, --qkv-format bshd (right-padded), same batch and budget",
        "ratio": round(pad["median_s"] / pk["median_s"], 4),
        "old_logprob_max_abs_diff": diff,  # same weights; bf16 kernels differ by format
        "padded_over_real_tokens": round(pad["tokens_computed"] / pad["real_tokens"],
                                         3) if pad["tokens_computed"] else None,
        "micro_batches": {"bshd": pad["micro_batches"], "thd": pk["micro_batches"]},
        "step_s": {"bshd": pad["step_s"], "thd": pk["step_s"]},
        "peak_mem_gib": {"bshd": pad["peak_mem_gib"], "thd": pk["peak_mem_gib"]},
        "batch": {"samples": a.samples, "prompt": a.prompt, "max_response": a.max_response,
                  "response": "lognormal(log(max/8), 1), capped", "real_tokens": pk["real_tokens"],
                  "max_tokens_per_gpu": a.max_tokens_per_gpu},
        "model": "tiny-qwen3" if a.tiny else f"qwen3-1.7B shape, {a.layers} layers, random init, bf16",
        "gpu": pk["gpu"], "torch": torch.__version__,
    }
    line = json.dumps(res)
    print(line, flush=True)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(line + "\n")


if __name__ == "__main__":
    main()
