"""One process, one GPU (run by test_cpu_offload.py): the real trainer setup (megatron-core,
tiny-qwen3 in bf16, distributed optimizer) trains rollouts 0..N-1 of a fixed synthetic stream,
optionally with megatron's CPU optimizer offload, saving or loading rlslurm's checkpoint after
`--save-at` / from `--load`, and writes the final weights (HF names) to `--out`.

`--trace` also records every optimizer step: the gradients megatron's optimizer received, the grad
norm it returned, the gradients after its clipping, the gradients the offloaded optimizer's CPU
copies stepped with, the fp32 main parameters and the bf16 weights after the step (step 0: before
training). `measure OUTDIR` runs the comparisons behind docs/gpu.md "CPU optimizer offload"
(GPU optimizer vs offload, and GPU optimizer vs GPU optimizer with another Adam kernel, the
rounding-noise control) in parallel and writes OUTDIR/summary.json."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
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


def _parts(opt):
    return getattr(opt, "chained_optimizers", None) or [opt]


def _main_params(st) -> list[tuple[str, torch.nn.Parameter, torch.Tensor]]:
    """(name, model param, its fp32 main shard) of the distributed optimizer; one DP rank, so the
    shard is the whole parameter."""
    names = {id(p): n for n, p in st.actor.model.named_parameters()}
    out = []
    for d in _parts(st.actor.optimizer):
        for mg, sg in zip(d.model_float16_groups + d.model_fp32_groups,
                          d.shard_fp32_from_float16_groups + d.shard_fp32_groups):
            out += [(names[id(mp)], mp, sp) for mp, sp in zip(mg, sg)]
    return out


def _set_adam(opt, impl: str) -> None:
    """Pick torch AdamW's kernel: the GPU optimizer's (megatron: torch AdamW, foreach by default
    on CUDA) or the offloaded CPU copies' (megatron passes fused=True; the HybridDeviceOptimizer
    copies its param groups into its CPU AdamW before every step)."""
    flags = {"foreach": (False, True), "fused": (True, False), "single": (False, False)}[impl]
    for d in _parts(opt):
        for g in d.optimizer.param_groups:
            g["fused"], g["foreach"] = flags


def _stepping_groups(opt) -> list[dict]:
    """Hyperparameters of the torch optimizers that stepped (the offload's CPU AdamW, not the
    HybridDeviceOptimizer's own groups)."""
    out = []
    for d in _parts(opt):
        inner = d.optimizer
        for o in getattr(inner, "sub_optimizers", None) or [inner]:
            for g in o.param_groups:
                row = {k: g.get(k) for k in ("lr", "weight_decay", "eps", "betas", "fused", "foreach", "amsgrad",
                                             "maximize", "capturable")}
                row["numel"] = sum(p.numel() for p in g["params"])
                row["steps"] = sorted({float(o.state[p]["step"]) for p in g["params"] if "step" in o.state.get(p, {})})
                row["cls"] = type(o).__name__
                row["device"] = str(g["params"][0].device)
                out.append(row)
    return out


def _trace(st, record: list) -> None:
    """Wrap the actor optimizer's step so each step appends its record (see module doc)."""
    from rlslurm.convert import mcore_to_hf

    opt = st.actor.optimizer
    inner_step = opt.step
    mains = _main_params(st)

    def cpu(t: torch.Tensor) -> torch.Tensor:
        return t.detach().float().cpu().clone()

    def weights() -> dict[str, torch.Tensor]:
        return {n: cpu(t) for n, t in mcore_to_hf(st.mc, st.actor.model)}

    def traced_step():
        pre = {n: cpu(mp.main_grad) for n, mp, _ in mains}
        lr = opt.param_groups[0]["lr"]
        ok, gn, nz = inner_step()
        rec = {"grad": pre, "grad_norm": None if gn is None else float(gn), "lr": lr,
               "clipped": {n: cpu(sp.grad) for n, _, sp in mains if sp.grad is not None},
               "main": {n: cpu(sp) for n, _, sp in mains}, "weights": weights()}
        cpu_grads = {}
        for d in _parts(opt):
            copies = getattr(d.optimizer, "gpu_params_map_cpu_copy", None)
            for n, _, sp in mains:
                if copies and sp in copies and copies[sp].grad is not None:
                    cpu_grads[n] = cpu(copies[sp].grad)
        if cpu_grads:
            rec["cpu_grad"] = cpu_grads
        rec["groups"] = _stepping_groups(opt)
        record.append(rec)
        return ok, gn, nz

    record.append({"main": {n: cpu(sp) for n, _, sp in mains}, "weights": weights()})
    opt.step = traced_step


def train(a: argparse.Namespace) -> None:
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(29500 + os.getpid() % 1000)), ("RANK", "0"),
                 ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)
    from rlslurm.buffer.progress import TrainerProgress
    from rlslurm.convert import mcore_to_hf
    from rlslurm.settings.config import RunConfig
    from rlslurm.trainer import checkpoint, step as steps
    from rlslurm.trainer.setup import build_trainer, init_distributed

    init_distributed(a.device, timeout_minutes=5)
    megatron = {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.0} if a.offload else {}
    cfg = RunConfig.model_validate({
        "run": {"run_dir": tempfile.mkdtemp(), "device": a.device, "seed": a.seed},
        "model": {"model": "tiny-qwen3"},
        "rollout": {"num_rollout": max(1, a.rollouts), "rollout_batch_size": 2, "n_samples_per_prompt": 4},
        "train": {"micro_batch_size": 2, "global_batch_size": 4, "num_steps_per_rollout": 2, "lr": 1e-2,
                  "bf16": True, "use_distributed_optimizer": True, "clip_grad": a.clip_grad, "adam_eps": 1e-3},
        "megatron": megatron,
    })
    st = build_trainer(cfg, 1)
    progress = checkpoint.load(st, checkpoint.find_resume(a.ckpt)) if a.load else TrainerProgress()
    if a.adam:
        _set_adam(st.actor.optimizer, a.adam)
    record: list = []
    if a.trace:
        _trace(st, record)
    done = 0
    for rid in range(progress.next_rollout_id, a.rollouts):
        r = rollout(rid, 64)
        prep = steps.prepare(st, r)
        for k in range(2):
            if a.steps is not None and done >= a.steps:
                break
            steps.train_step(st, r, prep, k)
            done += 1
        progress.record_trained(r)
        if a.save_at is not None and progress.trained_rollouts == a.save_at:
            checkpoint.save(st, progress, a.ckpt, keep=2)
    out = {"weights": {n: t.float().cpu() for n, t in mcore_to_hf(st.mc, st.actor.model)}}
    if a.trace:
        out["trace"] = record
    torch.save(out, a.out)
    torch.distributed.destroy_process_group()


# --- comparisons -------------------------------------------------------------------------------

def rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest per-tensor max|a - b| / max|a| (the test's measure)."""
    return max(float((a[n] - b[n]).abs().max() / a[n].abs().max().clamp_min(1e-30)) for n in a)


def norm(g: dict[str, torch.Tensor]) -> float:
    return float(torch.stack([t.double().pow(2).sum() for t in g.values()]).sum().sqrt())


def compare(ta: list, tb: list) -> list[dict]:
    """Per step of two traces: did both optimizers get the same gradients, and how far apart are
    the fp32 main parameters and bf16 weights after the step."""
    rows = []
    for k, (x, y) in enumerate(zip(ta, tb)):
        row = {"step": k, "main_rel": rel(x["main"], y["main"]), "weights_rel": rel(x["weights"], y["weights"]),
               "weights_differ": sum(int((x["weights"][n] != y["weights"][n]).sum()) for n in x["weights"])}
        if k:
            row.update(grads_equal=all(torch.equal(x["grad"][n], y["grad"][n]) for n in x["grad"]),
                       grad_rel=rel(x["grad"], y["grad"]), grad_norm=[x["grad_norm"], y["grad_norm"]],
                       norm_pre=[norm(x["grad"]), norm(y["grad"])],
                       norm_clipped=[norm(x["clipped"]), norm(y["clipped"])],
                       update=max(float((x["main"][n] - ta[k - 1]["main"][n]).abs().max()) for n in x["main"]))
        rows.append(row)
    return rows


def cpu_vs_clipped(t: list) -> list[float]:
    """Per step of an offloaded run: max |CPU copy's grad - the GPU main grad after clipping|."""
    return [max(float((r["cpu_grad"][n] - r["clipped"][n]).abs().max()) for n in r["cpu_grad"])
            for r in t[1:] if "cpu_grad" in r]


def measure(outdir: Path, seeds: list[int], par: int, device: str = "cuda") -> None:
    """Run the matrix (see module doc) `par` workers at a time on the one GPU; write summary.json."""
    work = Path(tempfile.mkdtemp())
    runs: dict[str, list[str]] = {}
    for s in seeds:
        for clip in ("1", "0"):
            base = ["--seed", str(s), "--clip-grad", clip, "--trace"]
            runs[f"gpu-s{s}-c{clip}"] = base
            runs[f"gpufused-s{s}-c{clip}"] = base + ["--adam", "fused"]
            runs[f"off-s{s}-c{clip}"] = base + ["--offload"]
    s0 = seeds[0]
    base = ["--seed", str(s0), "--clip-grad", "1", "--trace"]
    runs[f"gpurerun-s{s0}-c1"] = base
    runs[f"gpusingle-s{s0}-c1"] = base + ["--adam", "single"]
    runs[f"offsingle-s{s0}-c1"] = base + ["--offload", "--adam", "single"]
    env = {**os.environ, "OMP_NUM_THREADS": "2",
           "PYTHONPATH": f"{Path(__file__).resolve().parents[2]}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    names, failed = list(runs), {}
    for i in range(0, len(names), par):
        procs = {}
        for j, n in enumerate(names[i:i + par]):
            cmd = [sys.executable, __file__, "--out", str(work / f"{n}.pt"), "--ckpt", str(work / f"ck-{n}"),
                   "--device", device,
                   *runs[n]]
            procs[n] = subprocess.Popen(cmd, env={**env, "MASTER_PORT": str(29600 + i + j)},
                                        stdout=subprocess.DEVNULL, stderr=open(work / f"{n}.err", "w"))
        for n, p in procs.items():
            if p.wait() != 0:
                failed[n] = (work / f"{n}.err").read_text()[-3000:]
    print("failed:", list(failed), flush=True)
    traces = {n: torch.load(work / f"{n}.pt")["trace"] for n in names if n not in failed}
    pairs = []
    for s in seeds:
        for clip in ("1", "0"):
            pairs += [(f"gpu-s{s}-c{clip}", f"off-s{s}-c{clip}"), (f"gpu-s{s}-c{clip}", f"gpufused-s{s}-c{clip}")]
    pairs += [(f"gpu-s{s0}-c1", f"gpurerun-s{s0}-c1"), (f"gpu-s{s0}-c1", f"gpusingle-s{s0}-c1"),
              (f"off-s{s0}-c1", f"offsingle-s{s0}-c1")]
    summary = {"failed": failed, "pairs": {}, "cpu_grad_vs_clipped": {}}
    for a, b in pairs:
        if a in traces and b in traces:
            rows = compare(traces[a], traces[b])
            summary["pairs"][f"{a} vs {b}"] = rows
            print(f"{a} vs {b}: step1 main_rel {rows[1]['main_rel']:.2e} grads_equal {rows[1]['grads_equal']} | "
                  f"weights_rel per step " + " ".join(f"{r['weights_rel']:.3f}" for r in rows[1:]), flush=True)
    for n, t in traces.items():
        if n.startswith("off"):
            summary["cpu_grad_vs_clipped"][n] = cpu_vs_clipped(t)
    for n in (f"gpu-s{s0}-c1", f"off-s{s0}-c1"):
        if n in traces:
            summary[f"groups {n}"] = [traces[n][1]["groups"], traces[n][-1]["groups"]]
    for n in (f"gpu-s{s0}-c1", f"gpu-s{s0}-c0"):
        if n in traces:
            summary[f"grad_norms {n}"] = [[r["grad_norm"], norm(r["grad"]), norm(r["clipped"])] for r in traces[n][1:]]
    outdir.mkdir(parents=True, exist_ok=True)
    for n in (f"gpu-s{s0}-c1", f"off-s{s0}-c1"):  # for reading here; the gradients' checks are in the summary
        if n in traces:
            torch.save([{k: v for k, v in r.items() if k not in ("clipped", "cpu_grad")} for r in traces[n]],
                       outdir / f"{n}.pt")
    (outdir / "summary.json").write_text(json.dumps(summary, indent=1))


def main() -> None:
    if sys.argv[1:2] == ["measure"]:
        ap = argparse.ArgumentParser()
        ap.add_argument("outdir", type=Path)
        ap.add_argument("--seeds", type=int, nargs="+", default=[3, 4, 5])
        ap.add_argument("--par", type=int, default=8)
        ap.add_argument("--device", default="cuda")
        m = ap.parse_args(sys.argv[2:])
        return measure(m.outdir, m.seeds, m.par, m.device)
    ap = argparse.ArgumentParser()
    ap.add_argument("--offload", action="store_true")
    ap.add_argument("--rollouts", type=int, default=4)
    ap.add_argument("--steps", type=int, default=None, help="stop after this many optimizer steps")
    ap.add_argument("--save-at", type=int, default=None)
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--load", action="store_true")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda", help="cpu: check this script without offload")
    ap.add_argument("--clip-grad", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--adam", choices=["foreach", "fused", "single"], default=None,
                    help="torch AdamW kernel (default: megatron's choice)")
    ap.add_argument("--trace", action="store_true")
    train(ap.parse_args())


if __name__ == "__main__":
    main()
