"""Checkpoint cost: the training stall per save and the time from a preempt/TERM to its ack, with
asynchronous saves (rlslurm/trainer/checkpoint/writer.py) and without (--no-async-save).

One trainer process (rank 0 of 1; bench_trainer.py's set-up: random init, the qwen3-1.7B shape by
default, bf16, distributed optimizer, one GPU), a real optimizer step before each save so that Adam
state exists. Per mode:

- stall_s: `Checkpointer.start` until it returns, i.e. what the trainer waits for each save: synchronous,
  the whole save; asynchronous, planning + common.pt + the copy off the GPU;
- latest_s: start until the checkpoint is complete, verified and `latest` (in the background when
  asynchronous);
- step_s / step_during_write_s: a training step alone and while a write is in flight (what the
  background writer costs the trainer);
- ack_s: what the trainer does between noticing a TERM (or USR1, or a stop) and writing its ack,
  taken right after a periodic save was handed off (the worst case: a save in flight): wait for it,
  save the newest state, wait (trainer/main.py `_preempt`). The real TERM -> ack adds at most one
  control-file poll (1 s) and the step in progress.

The staging area is reserved in the background right after the model is built, as the trainer does
(`Checkpointer.prepare`), unless --no-reserve-ahead; the line records the warm-up step beside it and
what was left of the reservation after it (a real trainer spends that time waiting for its engines).

Prints one JSON line per mode.

    python bench/bench_checkpoint.py --out bench/results/checkpoint-<gpu>.jsonl     # GPU
    python bench/bench_checkpoint.py --tiny --cpu                                    # smoke test (CPU)
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_trainer import _sync, bench_trainer, make_rollout  # noqa: E402


def _timed(fn) -> float:
    _sync()
    t = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t


def run_mode(st, rollout, prep, *, asynchronous: bool, saves: int, root: Path) -> dict:
    from rlslurm.buffer.progress import TrainerProgress
    from rlslurm.trainer import step as steps
    from rlslurm.trainer.checkpoint import Checkpointer, checkpoint_bytes

    ck = Checkpointer(root, keep=2, asynchronous=asynchronous)
    progress = TrainerProgress()

    def train() -> None:
        steps.train_step(st, rollout, prep, 0)
        progress.record_trained(progress.next_rollout_id)

    stall, latest, step_alone, step_during, staged = [], [], [], [], []
    for _ in range(saves):
        step_alone.append(_timed(train))
        t0 = time.perf_counter()
        stall.append(_timed(lambda: ck.start(st, progress)))
        if asynchronous:
            step_during.append(_timed(train))  # the trainer trains on while it is written
        saved = ck.wait()
        latest.append(saved.total_s if saved is not None else time.perf_counter() - t0)
        if saved is not None:  # how this rank's copy was staged (trainer/checkpoint/staging.py) and its seconds
            staged.append((saved.staging, round(saved.stage_s, 3)))
    # the preempt path with a save in flight: wait for it, save the newest state, wait
    train()
    ck.start(st, progress)
    train()
    t = time.perf_counter()
    ck.wait()
    ck.start(st, progress)
    ck.wait()
    ack = time.perf_counter() - t
    size = checkpoint_bytes(sorted(root.glob("iter_*"))[-1])
    med = statistics.median
    return {"mode": "async" if asynchronous else "sync", "saves": saves, "checkpoint_gib": round(size / 2**30, 2),
            "stall_s": round(med(stall), 3), "stall_s_all": [round(x, 3) for x in stall],
            # the first save also allocates and page-locks the staging area; later saves reuse it
            "stall_s_after_first": round(med(stall[1:]), 3) if len(stall) > 1 else None,
            "staging": sorted({s for s, _ in staged}), "copy_s_all": [c for _, c in staged],
            "latest_s": round(med(latest), 3), "step_s": round(med(step_alone), 3),
            "step_during_write_s": round(med(step_during), 3) if step_during else None,
            "ack_with_save_in_flight_s": round(ack, 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--modes", default="async,sync")
    ap.add_argument("--no-reserve-ahead", dest="reserve_ahead", action="store_false",
                    help="do not reserve the staging area at start (the trainer does; then the first save makes it)")
    ap.add_argument("--dir", type=Path, default=None, help="where checkpoints go (default: a temp dir); "
                    "put it on the filesystem runs use")
    ap.add_argument("--tiny", action="store_true", help="tiny-qwen3 in fp32 (script smoke test)")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.tiny:  # the smoke test: a small batch
        a.samples, a.seq, a.prompt, a.mbs = min(a.samples, 4), min(a.seq, 64), min(a.prompt, 16), min(a.mbs, 2)

    from rlslurm.trainer import step as steps

    t0 = time.perf_counter()
    st, vocab = bench_trainer(tiny=a.tiny, cpu=a.cpu, layers=a.layers,
                              train={"micro_batch_size": a.mbs, "global_batch_size": a.samples})
    build_s = time.perf_counter() - t0
    rollout = make_rollout(a.samples, a.seq, a.prompt, vocab)
    reserve = {}
    t_res = time.perf_counter()
    if a.reserve_ahead:  # as trainer/main.py does right after the model is built
        from rlslurm.trainer.checkpoint import Checkpointer

        Checkpointer.prepare(st)
    prep = steps.prepare(st, rollout)
    # warm-up: Adam state exists from here on; timed, as it runs beside the reservation (GIL, memory bandwidth)
    reserve["warmup_step_s"] = round(_timed(lambda: steps.train_step(st, rollout, prep, 0)), 3)
    if a.reserve_ahead:
        from rlslurm.trainer.checkpoint import staging

        # a real trainer waits here for its engines and the first rollout (tens of seconds on a GPU):
        # what is left of the reservation after the warm-up step, and its whole time
        t = time.perf_counter()
        staging.area().wait_reserved()
        reserve.update(reserve_wait_after_warmup_s=round(time.perf_counter() - t, 3),
                       reserve_total_s=round(time.perf_counter() - t_res, 3))
    base = a.dir or Path(tempfile.mkdtemp(prefix="rlslurm-bench-ckpt-"))
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() and not a.cpu else "cpu"
    lines = []
    for mode in a.modes.split(","):
        root = base / f"checkpoints-{mode}"
        shutil.rmtree(root, ignore_errors=True)
        res = run_mode(st, rollout, prep, asynchronous=mode == "async", saves=a.saves, root=root)
        res.update({"bench": "checkpoint_stall_and_ack", "gpu": gpu, "torch": torch.__version__,
                    "model": "tiny-qwen3" if a.tiny else f"qwen3-1.7B shape, {a.layers} layers, random init",
                    "params": sum(p.numel() for p in st.actor.model.parameters()), "dir": str(root),
                    "build_s": round(build_s, 1), "goal_stall_s": 2.0, "reserve_ahead": a.reserve_ahead, **reserve})
        line = json.dumps(res)
        print(line, flush=True)
        lines.append(line)
        shutil.rmtree(root, ignore_errors=True)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        with open(a.out, "a") as f:
            f.write("\n".join(lines) + "\n")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
