"""Run under torchrun by test_trainer_step.py / test_trainer_pp.py: build the trainer from a run
directory, check its log-probs against HF transformers on the same weights, then train one rollout
and dump losses and the updated weights (exported to HF names, gathered over TP and from every
pipeline stage) for cross-layout comparison.

Writes <out>/result.json and <out>/weights.pt from global rank 0. Several `--run-dir R --out O` pairs
(all of one world size): the runs in turn in one set of processes, each from a fresh megatron parallel
state at its own layout (a torchrun start costs ~15 s of imports per process on the 2-core CI box).
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
    a = ap.parse_args()
    assert len(a.run_dir) == len(a.out), "one --out per --run-dir"
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps

    from rlslurm.trainer.setup import init_distributed

    init_distributed("cpu", 10)
    for run_dir, out in zip(a.run_dir, a.out):
        one_run(run_dir, out)
        # the next run sets megatron's parallel state up again at its own layout, as a fresh process
        # would (init_parallel: model_parallel_is_initialized() is False again), in the same process group
        ps.destroy_model_parallel()
        dist.barrier()
    dist.destroy_process_group()


def one_run(run_dir: Path, out_dir: Path) -> None:
    from rlslurm.buffer import RolloutReader
    from rlslurm.convert import mcore_to_hf
    from rlslurm.runfile import load_run_config
    from megatron.core import parallel_state as ps

    from rlslurm.trainer import logprobs as lp
    from rlslurm.trainer import step as steps
    from rlslurm.trainer.pipeline import logits_on_every_stage, stages_to_first
    from rlslurm.trainer.batching import collate, collate_packed
    from rlslurm.trainer.setup import build_trainer, init_distributed

    cfg = load_run_config(run_dir)
    rank, world = init_distributed("cpu", 10)  # joined already: this rank and the world size
    st = build_trainer(cfg, world)
    rollout = RolloutReader(run_dir, readonly=True).read(0)
    result: dict = {"tp": st.par.tp, "dp": st.par.dp, "pp": st.par.pp}

    # Log-probs and entropy of every sample under the trainer's path (this rank's TP shard of the
    # vocabulary), before any update; all samples on every rank so that rank 0 can compare them.
    # Packed (--qkv-format thd, one pipeline stage): the samples in one row, through the model's
    # packed attention and per-sequence rotary positions.
    idx = list(range(len(rollout.samples)))
    packed = cfg.train.qkv_format == "thd" and st.par.pp == 1
    mb = (collate_packed if packed else collate)(rollout.samples, idx, st.device)
    with torch.no_grad():
        st.actor.model.eval()
        out = lp.forward_logits(st.actor.model, mb) if packed else logits_on_every_stage(st.actor.model, mb.tokens)
        x = lp.prepare_logits(out.float(), st.vocab_size)
        st.actor.model.train()
        ent = lp.response_slices(lp.vocab_parallel_entropy(x), mb)
        logp = lp.response_slices(lp.token_logprobs(x, mb.tokens), mb)
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
                diffs.append(float((ref[p - 1:] - logp[i]).abs().max()))
                h = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)[p - 1:]
                ediffs.append(float((h - ent[i]).abs().max()))
        result["logprob_max_abs_diff"] = max(diffs)
        result["entropy_max_abs_diff"] = max(ediffs)
        result["logprob_scale"] = float(torch.cat(logp).abs().max())

    prep = steps.prepare(st, rollout)
    result["steps"] = [steps.train_step(st, rollout, prep, k) for k in range(cfg.train.num_steps_per_rollout)]
    weights = {}
    sender = ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0
    for name, t in stages_to_first(mcore_to_hf(st.mc, st.actor.model), sender=sender):
        weights[name] = t.clone()
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        torch.save(weights, out_dir / "weights.pt")
        (out_dir / "result.json").write_text(json.dumps(result, indent=1))
    dist.barrier()


if __name__ == "__main__":
    main()
