"""What --colocate costs per rollout, through the product (`rlslurm run --colocate`).

The trainer (megatron-core, bf16, one rank per GPU, --tp) and real SGLang engines (torch_memory_saver;
--engine-tp GPUs each) on the first --gpus GPUs, taking turns (docs/colocate.md); a random-init model of a shipped
config (qwen3-1.7B by default), the demo prompts and reward (token ids only, as in bench_grpo_iteration.py). Per rollout
the colocation adds

    engines release -> trainer onload (the optimizer state beside the first fwd/bwd) -> [train] -> offload
    -> engines resume -> publish -> resume

The publish goes by --transport: `ipc` (the default with --colocate: each bucket read in place by the
engine on the same GPU, trainer/weights/ipc.py) or `broadcast` (gloo through host memory).

Figures are medians over rollouts 1.. (rollout 0 is warm-up) from the run's metrics.jsonl: the
overhead (release + onload + offload + resume, and the publish apart), each as a share of the
iteration; the GPU memory in use after each phase. `--offload-train` moves the trainer's state off the
GPUs for the engines' turn, `--no-offload-train` keeps it there, and by default the trainer keeps what
fits (docs/colocate.md); what it moved is read back from its record (control/colocate_memory.json,
`trainer_moves`), not assumed from the flag.

Reference, same call, same GPU: a device-to-device copy of the bytes the publish moves (the HF
checkpoint's size). figure = publish GB/s, ratio = publish / D2D (issue 13's target for a same-GPU
weight update is >= 0.8). With ipc the engine's own side is reported apart: its in-place copies' GB/s
from the receiver's log lines (after the first publish, which learns the copies).

    python3 bench/bench_colocate.py --out bench/results/colocate-h100.jsonl
    python3 bench/bench_colocate.py --model qwen3-4B --gpus 2 --tp 2 --engine-tp 2 --no-offload-train
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.gpu.bundle_flags import mem_flags, run_flags  # noqa: E402

# time/onload_wait: what the first optimizer step waited for the optimizer state's copy back, which runs
# beside the turn's first forward/backward (trainer/colocate.py to_trainer)
PHASES = ("time/engines_release", "time/onload", "time/onload_wait", "time/offload", "time/engines_resume")


def med(xs: list[float]) -> float:
    return round(statistics.median(xs), 4) if xs else float("nan")


def d2d_gb_s(nbytes: int, iters: int = 5) -> float:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    torch.cuda.synchronize()
    return nbytes * iters / (time.perf_counter() - t) / 1e9


def engine_copies(run_dir: Path) -> dict:
    """The engine's side of the ipc publishes, from rlslurm's receiver lines in its log: requests after
    the last one that learnt a layout (learning runs SGLang's load_weights), their GB and copy seconds."""
    import re

    pat = re.compile(r"rlslurm receiver: 1 buckets read in place, ([\d.]+) GB: .*loaded ([\d.]+) ms")
    gb = secs = 0.0
    n = 0
    for p in sorted(run_dir.rglob("engine-*.log")):
        lines = p.read_text(errors="replace").splitlines()
        last_learn = max((i for i, l in enumerate(lines) if "learnt copies from now on" in l
                          or "keeps SGLang's load_weights" in l), default=-1)
        for l in lines[last_learn + 1:]:
            m = pat.search(l)
            if m:
                gb, secs, n = gb + float(m.group(1)), secs + float(m.group(2)) / 1e3, n + 1
    return {"requests": n, "gb": round(gb, 3), "copy_s": round(secs, 4),
            "gb_per_s": round(gb / secs, 1) if secs else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-1.7B")
    ap.add_argument("--num-rollout", type=int, default=5)
    ap.add_argument("--rollout-batch-size", type=int, default=16)
    ap.add_argument("--n-samples", type=int, default=8)
    ap.add_argument("--response-len", type=int, default=256)
    # the trainer's micro-batches: its logits (tokens x 151 k vocabulary, fp32) are the activation peak,
    # and on an 80 GB GPU the shipped 9216 left NCCL's first 512 MiB buffer no room (H100, 1.7B)
    ap.add_argument("--max-tokens-per-gpu", type=int, default=4096)
    ap.add_argument("--mem-fraction", type=float, default=None,
                    help="the engine's --sglang-mem-fraction-static (default: rlslurm derives it)")
    ap.add_argument("--transport", choices=("ipc", "broadcast"), default="ipc")
    ap.add_argument("--gpus", type=int, default=1, help="GPUs of the node the run takes (--gpus-per-node)")
    ap.add_argument("--tp", type=int, default=1, help="the trainer's --tensor-model-parallel-size")
    ap.add_argument("--engine-tp", type=int, default=1, help="--rollout-num-gpus-per-engine")
    ap.add_argument("--offload-train", action=argparse.BooleanOptionalAction, default=None,
                    help="--offload-train / --no-offload-train (default: rlslurm's)")
    ap.add_argument("--transformer-impl", choices=("local", "transformer_engine"), default=None,
                    help="the trainer's --transformer-impl (default: rlslurm's, local)")
    ap.add_argument("--bucket-bytes", type=int, default=None, help="--update-weight-buffer-size (default: rlslurm's)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/rlslurm-colocate-bench"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--cpu-smoke", action="store_true", help="check the script: tiny-qwen3 on CPU, no reference")
    a = ap.parse_args()
    if a.cpu_smoke:
        a.model, a.response_len, a.rollout_batch_size, a.n_samples = "tiny-qwen3", 16, 4, 4

    import torch
    from demo_run import checkpoint_and_prompts, run_command, run_logged

    ckpt, prompts = checkpoint_and_prompts(a.model, a.work, cpu=a.cpu_smoke)
    nbytes = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    run_dir = a.work / f"run-{int(time.time())}"
    batch = a.rollout_batch_size * a.n_samples
    cmd = [*run_command(a.model, ckpt, prompts, run_dir, num_rollout=a.num_rollout, save_interval=10**6,
                        rollout_batch_size=a.rollout_batch_size, n_samples=a.n_samples, response_len=a.response_len),
           "--colocate", "--max-tokens-per-gpu", str(a.max_tokens_per_gpu), "--weight-sync-transport", a.transport,
           *(["--update-weight-buffer-size", str(a.bucket_bytes)] if a.bucket_bytes else []),
           *(["--device", "cpu", "--rollout-dtype", "float32"] if a.cpu_smoke else
             ["--device", "cuda", "--gpus-per-node", str(a.gpus), *run_flags(),
              *mem_flags(a.mem_fraction, "--sglang-")]),
           "--tensor-model-parallel-size", str(a.tp), "--rollout-num-gpus-per-engine", str(a.engine_tp),
           *([] if a.transformer_impl is None else ["--transformer-impl", a.transformer_impl]),
           # transformer-engine is in no supported stack yet (rlslurm/stacks.py): tried as a user would try it
           *(["--allow-untested-stack"] if a.transformer_impl == "transformer_engine" else []),
           *([] if a.offload_train is None else ["--offload-train" if a.offload_train else "--no-offload-train"])]
    wall = run_logged(cmd, a.work / "run.log")
    gpu = "cpu" if a.cpu_smoke else torch.cuda.get_device_name(0)  # after the run: no CUDA context of ours in it
    try:  # what the trainer moved, as it recorded it (rlslurm/trainer/offload_choice.py)
        offload = json.loads((run_dir / "control" / "colocate_memory.json").read_text())["offload"]
        moved = offload["moves"]
    except (OSError, KeyError, TypeError, ValueError) as e:
        raise SystemExit(f"{run_dir}/control/colocate_memory.json does not say what the trainer moved: {e}")

    lines = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    per_rollout = {m["rollout_id"]: m for m in lines}  # phases repeat on each step of a rollout
    steady = [per_rollout[r] for r in sorted(per_rollout) if r >= 1]
    last_line = {m["rollout_id"]: m["time"] for m in lines}
    iters = [last_line[r] - last_line[r - 1] for r in sorted(last_line) if r >= 1 and r - 1 in last_line]
    iteration = med(iters)
    phases = {k.split("/")[1]: med([m.get(k, 0.0) for m in steady])
              for k in (*PHASES, "time/publish", "time/actor_step")}
    overhead = round(sum(phases[k.split("/")[1]] for k in PHASES), 4)
    res: dict = {
        "bench": "colocate_rlslurm_run",
        "model": f"{a.model} config, random init, {'fp32' if a.cpu_smoke else 'bf16'}", "gpu": gpu,
        "torch": torch.__version__,
        "samples": batch, "response_len_max": a.response_len, "num_rollout": a.num_rollout,
        "iteration_s": iteration, "phases_s": phases,
        "colocation_overhead_s": overhead, "overhead_share": round(overhead / iteration, 4) if iteration else None,
        "publish_share": round(phases["publish"] / iteration, 4) if iteration else None,
        "mem_gib": {k.split("/", 1)[1]: round(med([m[k] for m in steady if k in m]), 2)
                    for k in sorted({k for m in steady for k in m if k.startswith("mem/")})},
        "publish_bytes": nbytes, "run_wall_s": round(wall, 1), "transport": a.transport,
        "bucket_bytes": a.bucket_bytes,
        "transformer_impl": a.transformer_impl or "local", "gpus": a.gpus, "trainer_tp": a.tp, "engine_tp": a.engine_tp,
        "offload_train": bool(moved), "trainer_moves": moved, "offload_setting": offload.get("setting"),
        "offload_rechecks": offload.get("rechecks", []), "rest_kept_gib": offload.get("rest_kept_gib", 0.0),
    }
    if a.transport == "ipc":
        res["engine_in_place_copy"] = engine_copies(run_dir)
    if not a.cpu_smoke:
        ref = d2d_gb_s(nbytes)
        fig = nbytes / phases["publish"] / 1e9
        how = "in place, CUDA IPC" if a.transport == "ipc" else "gloo broadcast"
        res.update({"figure": round(fig, 2), "figure_name": f"publish GB/s into the engine on the same GPU ({how})",
                    "reference": round(ref, 1), "reference_name": "device-to-device copy GB/s, same bytes, same GPU",
                    "ratio": round(fig / ref, 4)})
    line = json.dumps(res)
    print(line, flush=True)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        with a.out.open("a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
