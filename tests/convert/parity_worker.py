"""Parity worker, run under torchrun by tests/convert (one process per TP rank, gloo, CPU).

For every model config named on the command line: build the Megatron GPTModel at TP=world size,
load the HF checkpoint `<ckpt_root>/<model>` through rlslurm.convert, and record
- max |logits_megatron - logits_hf| on a fixed batch (HF transformers on the same files, fp32),
- the HF -> Megatron -> HF round trip: every exported tensor compared with the file, bit for bit,
- the loss on the same batch (for TP=1 vs TP=2 comparisons).
Rank 0 writes one JSON file per model to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt-root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("models", nargs="+")
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    from rlslurm.trainer import cpu_shim

    cpu_shim.apply()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from rlslurm.convert import HFCheckpoint, load_hf_checkpoint, mcore_to_hf
    from rlslurm.model_config import load_model_config
    from rlslurm.trainer.model import build_gpt_model, padded_vocab_size, transformer_config

    tp = world // args.ep
    out = Path(args.out)
    for name in args.models:
        result: dict = {"model": name, "tp": tp, "ep": args.ep}
        try:
            ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=args.ep)
            model_parallel_cuda_manual_seed(1234)
            mc = load_model_config(name)
            hf_dir = Path(args.ckpt_root) / name
            tcfg = transformer_config(mc, params_dtype=torch.float32, tp=tp, pp=1, ep=args.ep, cp=1, overrides={})
            vpad = padded_vocab_size(mc.arch.vocab_size, tp)
            model = build_gpt_model(mc, tcfg, vocab_size_padded=vpad)
            model.eval()
            summary = load_hf_checkpoint(model, mc, hf_dir)
            result["loaded_tensors"] = summary["tensors"]

            g = torch.Generator().manual_seed(0)
            ids = torch.randint(0, mc.arch.vocab_size, (2, 12), generator=g)
            pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
            with torch.no_grad():
                logits = model(ids, pos, None)  # [b, s, vocab/tp]
                logits = gather_from_tensor_model_parallel_region(logits)[..., : mc.arch.vocab_size]
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                     ids[:, 1:].reshape(-1))
            result["loss"] = float(loss)

            exported = {}
            for hf_name, t in mcore_to_hf(mc, model):
                if hf_name in exported:
                    raise AssertionError(f"exported twice: {hf_name}")
                exported[hf_name] = t
            if rank == 0:
                from transformers import AutoModelForCausalLM

                hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
                with torch.no_grad():
                    ref = hf(ids).logits
                result["max_abs_logits"] = float((ref - logits).abs().max())
                result["ref_logit_scale"] = float(ref.abs().max())
                ckpt = HFCheckpoint(hf_dir)
                names = set(ckpt.names())
                result["missing_in_export"] = sorted(names - set(exported))
                result["extra_in_export"] = sorted(set(exported) - names)
                result["not_bit_exact"] = sorted(
                    n for n in names & set(exported)
                    if exported[n].dtype != ckpt.get(n).dtype or not torch.equal(exported[n], ckpt.get(n)))
                result["exported"] = len(exported)
            result["ok"] = True
        except Exception as e:  # recorded, so one family's failure does not hide the others'
            result["ok"] = False
            result["error"] = "".join(traceback.format_exception(e))[-4000:]
            print(result["error"], file=sys.stderr)
        finally:
            ps.destroy_model_parallel()
        if rank == 0:
            (out / f"{name}.tp{tp}.ep{args.ep}.json").write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
