"""Diagnose a resume that is not bit-exact: compare every piece of trainer state right after a
checkpoint load with the in-memory state of the run that saved it, and the weights after training on.

    python tools/diag_resume_state.py [--dist-opt] [--bf16] [--nproc 2] [--keep DIR]

Straight attempt (torchrun, gloo): train rollout 0, save, snapshot, train rollout 1, snapshot.
Resume attempt (a fresh torchrun): build, load the checkpoint, snapshot, train rollout 1, snapshot.
Prints every state entry whose resumed value differs from the saved one (params, main params,
exp_avg/exp_avg_sq/step, param_groups' hyperparameters, grad/param buffers and their bucket
layout, LR scheduler, RNG, module buffers), then whether the final weights match.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------ worker (torchrun)


def _opt_parts(opt) -> list:
    return getattr(opt, "chained_optimizers", None) or [opt]


def snapshot(st) -> dict[str, Any]:
    """Everything a resumed trainer must have equal to the saver, as plain tensors/values."""
    from rlslurm.trainer.checkpoint.state import rng_state

    snap: dict[str, Any] = {}
    ddp = st.actor.model
    for n, p in ddp.named_parameters():
        snap[f"param/{n}"] = p.detach().clone()
    for n, b in ddp.named_buffers():
        snap[f"module_buffer/{n}"] = b.detach().clone()
    for i, buf in enumerate(getattr(ddp, "buffers", [])):
        snap[f"ddp/{i}/grad_data"] = buf.grad_data.detach().clone()
        if buf.param_data is not None:
            snap[f"ddp/{i}/param_data"] = buf.param_data.detach().clone()
        names = {p: n for n, p in ddp.named_parameters()}
        snap[f"ddp/{i}/layout"] = [(names.get(p, "?"), r) for p, r in buf.param_index_map.items()]
        snap[f"ddp/{i}/buckets"] = [(b.offset, b.grad_data.numel()) for b in buf.buckets]
    for k, part in enumerate(_opt_parts(st.actor.optimizer)):
        inner = getattr(part, "optimizer", part)
        for gi, g in enumerate(inner.param_groups):
            snap[f"opt{k}/group{gi}/hyper"] = {h: v for h, v in g.items() if h != "params"}
            for pi, p in enumerate(g["params"]):
                snap[f"opt{k}/group{gi}/main{pi}"] = p.detach().clone()
                for sk, sv in inner.state.get(p, {}).items():
                    snap[f"opt{k}/group{gi}/{sk}{pi}"] = sv.detach().clone() if torch.is_tensor(sv) else sv
        if getattr(part, "grad_scaler", None) is not None:
            snap[f"opt{k}/grad_scaler"] = part.grad_scaler.state_dict()
    snap["scheduler"] = st.actor.scheduler.state_dict()
    rng = rng_state()
    snap["rng/python"] = rng["random"]
    snap["rng/numpy"] = [x.tolist() if hasattr(x, "tolist") else x for x in rng["numpy"]]
    snap["rng/torch"] = rng["torch"]
    snap["rng/tracker"] = rng["tracker"]
    return snap


def _train(st, reader, rid: int) -> None:
    from rlslurm.trainer import step as steps

    rollout = reader.read(rid)
    prep = steps.prepare(st, rollout)
    for k in range(st.cfg.train.num_steps_per_rollout):
        steps.train_step(st, rollout, prep, k)


def worker(mode: str, run: Path, out: Path) -> None:
    import torch.distributed as dist

    from rlslurm.buffer.progress import TrainerProgress
    from rlslurm.buffer.reader import RolloutReader
    from rlslurm.settings.runfile import load_run_config
    from rlslurm.trainer import checkpoint
    from rlslurm.trainer.setup import build_trainer, init_distributed

    cfg = load_run_config(run)
    rank, world = init_distributed(cfg.run.device)
    st = build_trainer(cfg, world)
    reader = RolloutReader.replay(cfg.train.load_debug_rollout_data)
    ckroot = run / "checkpoints"
    if mode == "straight":
        progress = TrainerProgress()
        _train(st, reader, 0)
        progress.record_trained(0)
        torch.save(snapshot(st), out / f"presave_{rank}.pt")
        checkpoint.save(st, progress, ckroot, keep=5)
        torch.save(snapshot(st), out / f"save_{rank}.pt")
    else:
        checkpoint.load(st, ckroot / checkpoint.ckpt_name(1))
        torch.save(snapshot(st), out / f"load_{rank}.pt")
    _train(st, reader, 1)
    torch.save(snapshot(st), out / f"{mode}_final_{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------ driver


def _equal(a: Any, b: Any) -> tuple[bool, str]:
    if torch.is_tensor(a) and torch.is_tensor(b):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False, f"shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
        if a.dtype == torch.uint8:
            return bool((a == b).all()), "bytes differ"
        same = bool((a == b).all()) if a.numel() else True
        diff = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
        return same, f"max|diff|={diff:.3e} ({int((a != b).sum())}/{a.numel()} differ)"
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return False, f"keys {sorted(a)} vs {sorted(b)}"
        bad = [(k, m) for k in a for ok, m in [_equal(a[k], b[k])] if not ok]
        return not bad, "; ".join(f"{k}: {m}" for k, m in bad)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return False, f"len {len(a)} vs {len(b)}"
        bad = [(i, m) for i, (x, y) in enumerate(zip(a, b)) for ok, m in [_equal(x, y)] if not ok]
        return not bad, "; ".join(f"[{i}]: {m}" for i, m in bad[:3])
    return a == b, f"{a!r} vs {b!r}"


# Differences right after a load that cannot change what is trained next, and why.
EXPLAINED = {
    "grad_data": "gradients of the saver's last step; every step zeroes the grad buffer before its backward",
    "hyper.step": "megatron's distributed optimizer writes the checkpointed step into param_groups on load; "
                  "torch Adam reads the per-parameter state step (compared separately)",
}


def _explain(k: str, a: Any, b: Any) -> tuple[Any, Any, str | None]:
    if k.endswith("/grad_data"):
        return None, None, EXPLAINED["grad_data"]
    if k.endswith("/hyper") and isinstance(b, dict) and "step" in b and "step" not in a:
        return a, {h: v for h, v in b.items() if h != "step"}, EXPLAINED["hyper.step"]
    return a, b, None


def compare(a: dict, b: dict, what: str, explain: bool = False) -> int:
    bad = 0
    noted: set[str] = set()
    for k in sorted(a.keys() | b.keys()):
        if k not in a or k not in b:
            print(f"  {what}: {k} only in {'saved' if k in a else 'resumed'}")
            bad += 1
            continue
        x, y = a[k], b[k]
        if explain:
            x, y, why = _explain(k, x, y)
            if why is not None and why not in noted:
                noted.add(why)
                print(f"  {what}: not counted: {why}")
        ok, msg = _equal(x, y)
        if not ok:
            print(f"  {what}: {k}: {msg}")
            bad += 1
    return bad


def _torchrun(nproc: int, mode: str, run: Path, out: Path) -> None:
    from conftest import free_port  # tests/trainer

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), __file__, "--worker", mode, str(run), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}:{REPO / 'tests' / 'trainer'}"}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    if p.returncode:
        sys.exit(f"{mode} attempt failed rc={p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-8000:]}")


def driver(a: argparse.Namespace) -> int:
    sys.path[:0] = [str(REPO), str(REPO / "tests" / "trainer")]
    from conftest import commit_rollouts, make_run  # tests/trainer: run dirs and synthetic rollouts

    from rlslurm.settings.model_config import load_model_config
    from rlslurm.tiny import make_tiny_checkpoint

    tmp = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="diag_resume_"))
    shutil.rmtree(tmp, ignore_errors=True)  # a kept directory of an earlier run holds committed rollouts
    tmp.mkdir(parents=True)
    hf = make_tiny_checkpoint(load_model_config("tiny-qwen3"), tmp / "hf", seed=3)
    source = make_run(tmp / "source", hf)
    commit_rollouts(source, range(2))
    train = dict(use_distributed_optimizer=a.dist_opt, bf16=a.bf16, num_steps_per_rollout=2, global_batch_size=4,
                 micro_batch_size=1, lr_decay_style="cosine", lr_warmup_iters=1, use_kl_loss=True,
                 kl_loss_coef=0.05, entropy_coef=0.01, weight_decay=0.1, load_debug_rollout_data=str(source))
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    for mode in ("straight", "resume"):
        run = tmp / "run"
        if mode == "straight":
            make_run(run, hf, nproc=a.nproc, train=train, rollout=dict(num_rollout=2))
        _torchrun(a.nproc, mode, run, out)
    bad = 0
    for r in range(a.nproc):
        bad += compare(torch.load(out / f"presave_{r}.pt", weights_only=False),
                       torch.load(out / f"save_{r}.pt", weights_only=False), f"rank {r} save changed state")
        bad += compare(torch.load(out / f"save_{r}.pt", weights_only=False),
                       torch.load(out / f"load_{r}.pt", weights_only=False), f"rank {r} after load", explain=True)
        fa = torch.load(out / f"straight_final_{r}.pt", weights_only=False)
        fb = torch.load(out / f"resume_final_{r}.pt", weights_only=False)
        bad += compare({k: v for k, v in fa.items() if k.startswith("param/")},
                       {k: v for k, v in fb.items() if k.startswith("param/")}, f"rank {r} final weights")
    print(f"dist_opt={a.dist_opt} bf16={a.bf16} nproc={a.nproc}: {'BIT-EXACT' if not bad else f'{bad} differences'}"
          f" (files in {tmp})")
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]))
        sys.exit(0)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dist-opt", action="store_true", help="use megatron's distributed optimizer")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--keep", help="work directory to keep (default: a new temp dir)")
    sys.exit(driver(ap.parse_args()))
