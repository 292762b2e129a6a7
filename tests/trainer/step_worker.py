"""Run under torchrun by tests/trainer/conftest.py step_results (the runs of test_trainer_step.py,
test_trainer_pp.py, test_trainer_ep.py, test_trainer_loss_types.py): build the trainer from a run
directory, check its log-probs against HF transformers on the same weights, then train one rollout
and dump losses and the updated weights (published as the disk publisher does: HF names, gathered
over TP/ETP/EP and from every pipeline stage) for cross-layout comparison. With --resume-check RUN,
that run also checkpoints before its last step and checks that a resume takes the same step.

Writes <out>/result.json and <out>/weights.pt from global rank 0. Several `--run-dir R --out O` pairs
(all of one world size, of any of those modules): the runs in turn in one set of processes, each from a
fresh megatron parallel state at its own layout (a torchrun start costs ~15 s of imports per process on
the 2-core CI box).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True, type=Path, action="append")
    ap.add_argument("--out", required=True, type=Path, action="append")
    ap.add_argument("--resume-check", type=Path, action="append", default=[],
                    help="a --run-dir whose run also saves, trains, loads and trains its last step again")
    ap.add_argument("--resume-from", nargs=2, action="append", default=[], metavar=("RUN", "CKPT_ROOT"),
                    help="a --run-dir whose last step starts from CKPT_ROOT's checkpoint (saved before the last "
                         "step by another run's --resume-check, at another layout) instead of its own state")
    ap.add_argument("--device", default="cpu", help="cuda: NCCL, one GPU per rank (tests/gpu/test_context_parallel.py)")
    a = ap.parse_args()
    assert len(a.run_dir) == len(a.out), "one --out per --run-dir"
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps

    from rlslurm.trainer.setup import init_distributed

    init_distributed(a.device, 10)
    for run_dir, out in zip(a.run_dir, a.out):
        one_run(run_dir, out, resume_check=run_dir in a.resume_check, device=a.device,
                resume_from=dict((Path(r), Path(c)) for r, c in a.resume_from).get(run_dir))
        # the next run sets megatron's parallel state up again at its own layout, as a fresh process
        # would (init_parallel: model_parallel_is_initialized() is False again), in the same process group
        ps.destroy_model_parallel()
        dist.barrier()
    dist.destroy_process_group()


def one_run(run_dir: Path, out_dir: Path, resume_check: bool = False, device: str = "cpu",
            resume_from: Path | None = None) -> None:
    from rlslurm.buffer import RolloutReader
    from rlslurm.settings.runfile import load_run_config
    from rlslurm.trainer import logprobs as lp, step as steps
    from rlslurm.trainer.batching import collate, collate_packed
    from rlslurm.trainer.pipeline import logits_on_every_stage, segment_multiple, seq_multiple
    from rlslurm.trainer.setup import build_trainer, init_distributed
    from rlslurm.trainer.weights.disk import export_hf

    cfg = load_run_config(run_dir)
    rank, world = init_distributed(device, 10)  # joined already: this rank and the world size
    st = build_trainer(cfg, world)
    rollout = RolloutReader(run_dir, readonly=True).read(0)
    result: dict = {"tp": st.par.tp, "dp": st.par.dp, "pp": st.par.pp, "cp": st.par.cp}

    # Log-probs and entropy of every sample under the trainer's path (this rank's TP shard of the
    # vocabulary), before any update; all samples on every rank so that rank 0 can compare them.
    # Packed (--qkv-format thd, one pipeline stage): the samples in one row, through the model's
    # packed attention and per-sequence rotary positions.
    idx = list(range(len(rollout.samples)))
    # Context parallelism: padded, logits_on_every_stage gathers whole rows; packed, each CP rank's
    # columns go through the token functions, which gather the per-token results.
    packed = cfg.train.qkv_format == "thd" and st.par.pp == 1
    m = st.actor.model
    mb = (collate_packed(rollout.samples, idx, st.device, seq_multiple(m), segment_multiple=segment_multiple(m))
          if packed else collate(rollout.samples, idx, st.device))
    with torch.no_grad():
        st.actor.model.eval()
        out = lp.forward_logits(st.actor.model, mb) if packed else logits_on_every_stage(st.actor.model, mb.tokens)
        x = lp.prepare_logits(out.float(), st.vocab_size)
        st.actor.model.train()
        cp = lp.cp_slice(mb) if packed else None
        ent = lp.response_slices(lp.vocab_parallel_entropy(x, cp), mb)
        logp = lp.response_slices(lp.token_logprobs(x, mb.tokens, cp), mb)
    if rank == 0:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(cfg.model.hf_checkpoint, dtype=torch.float32).eval()
        diffs, ediffs = [], []
        with torch.no_grad():
            for i, s in enumerate(rollout.samples):
                ids = torch.from_numpy(s.tokens.astype("int64")).unsqueeze(0)
                logits = hf(ids).logits[0, :-1].float()
                ref = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
                p = len(s.prompt_tokens)
                diffs.append(float((ref[p - 1:] - logp[i].cpu()).abs().max()))
                h = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)[p - 1:]
                ediffs.append(float((h - ent[i].cpu()).abs().max()))
        result["logprob_max_abs_diff"] = max(diffs)
        result["entropy_max_abs_diff"] = max(ediffs)
        result["logprob_scale"] = float(torch.cat(logp).abs().max())

    prep = steps.prepare(st, rollout)
    n_steps = cfg.train.num_steps_per_rollout
    result["steps"] = [steps.train_step(st, rollout, prep, k) for k in range(n_steps - 1)]
    if resume_check:  # its last step is taken twice, the second time from the checkpoint
        result["resume"] = _resume_check(st, rollout, prep, n_steps - 1, run_dir / "checkpoints")
        result["steps"].append(result["resume"]["again"])
    else:
        if resume_from is not None:
            result["resumed_from"] = _load_other(st, resume_from)
        result["steps"].append(steps.train_step(st, rollout, prep, n_steps - 1))
    # the published weights: the disk publisher's own export (trainer/weights/disk.py export_hf: who takes
    # part in the TP/ETP/EP gathers, every pipeline stage to the first), read back from its files
    export_hf(st.mc, st.actor.model, run_dir / "published", hf_dir=cfg.model.hf_checkpoint)
    if rank == 0:
        from rlslurm.convert import HFCheckpoint

        ck = HFCheckpoint(run_dir / "published")
        weights = {name: ck.get(name) for name in ck.names()}
        out_dir.mkdir(parents=True, exist_ok=True)
        torch.save(weights, out_dir / "weights.pt")
        (out_dir / "result.json").write_text(json.dumps(result, indent=1))
    dist.barrier()


def _load_other(st, root: Path) -> str:
    """The newest checkpoint under `root`, written by another run at another layout, loaded over this
    run's state (perturbed first, so that only the checkpoint can bring the weights back)."""
    from rlslurm.trainer import checkpoint

    with torch.no_grad():
        for p in st.actor.model.parameters():
            p.add_(1.0)
    d = checkpoint.find_resume(root)
    assert d is not None, f"no checkpoint under {root}"
    checkpoint.load(st, d)
    return str(d)


def _resume_check(st, rollout, prep, k: int, root: Path) -> dict:
    """Save a checkpoint before step k, take step k, load the checkpoint and take step k again: the
    weights after the second must equal those after the first bit for bit (every rank's own shards:
    dist_checkpointing wrote and read them at this layout); both steps' metrics are returned."""
    from rlslurm.buffer.progress import TrainerProgress
    from rlslurm.trainer import checkpoint, step as steps

    d = checkpoint.save(st, TrainerProgress(), root, keep=1)
    first = steps.train_step(st, rollout, prep, k)
    straight = {n: p.detach().clone() for n, p in st.actor.model.named_parameters()}
    with torch.no_grad():  # the checkpoint must bring them back, not what is left in memory
        for p in st.actor.model.parameters():
            p.add_(1.0)
    checkpoint.load(st, d)
    again = steps.train_step(st, rollout, prep, k)
    worst = torch.tensor([max(float((p.detach() - straight[n]).abs().max())
                              for n, p in st.actor.model.named_parameters())])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {"max_abs_diff": float(worst), "first": first, "again": again,
            "expert_shards": sum(".experts." in n for n, _ in st.actor.model.named_parameters())}


if __name__ == "__main__":
    from rlslurm.exit_guard import skip_final_gc_at_exit

    skip_final_gc_at_exit()  # the product roles' exit: seconds of a core saved per torchrun worker
    main()
