"""Quantized checkpoint worker, run under torchrun by tests/convert/test_fp8_load.py (`--fp8-dir`) and
test_int4_load.py (`--int4-dir` + `--group`), one process per TP rank, gloo, CPU: build the Megatron
GPTModel (bf16 parameters) at TP = world size, load the block-wise FP8 or INT4 W4A16 checkpoint through
rlslurm.convert, and write (rank 0) what each side of rlslurm makes of it:

- loaded.safetensors: the loaded model exported in HF names (the trainer's bf16 weights);
- sync.safetensors + sync_order.json: what a weight sync sends (tries.py `SyncPublisher.stream`
  with the options factory.py builds from a plan whose fp8_block or int4_group is set);
- disk/: what the disk publisher / fallback writes (disk.py `export_hf` with the same quantizer);
- plain/: what --save-hf writes (no quantizer);
- summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="model config name or YAML")
    fmt = ap.add_mutually_exclusive_group(required=True)
    fmt.add_argument("--fp8-dir", help="a block-wise FP8 checkpoint (128x128 blocks)")
    fmt.add_argument("--int4-dir", help="an INT4 W4A16 checkpoint, in groups of --group columns")
    ap.add_argument("--group", type=int)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    from rlslurm.models import cpu_shim

    cpu_shim.apply()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from safetensors.torch import save_file

    from rlslurm.convert import load_hf_checkpoint, mcore_to_hf
    from rlslurm.models.build import build_gpt_model, padded_vocab_size, transformer_config
    from rlslurm.settings.model_config import load_model_config
    from rlslurm.settings.weight_plan import WeightSyncPlan
    from rlslurm.trainer.weights.base import SyncOptions
    from rlslurm.trainer.weights.disk import export_hf
    from rlslurm.trainer.weights.factory import quantized_export
    from rlslurm.trainer.weights.tries import SyncPublisher

    out, ckpt_dir = Path(args.out), Path(args.fp8_dir or args.int4_dir)
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    model_parallel_cuda_manual_seed(1)
    mc = load_model_config(args.model)
    tcfg = transformer_config(mc, params_dtype=torch.bfloat16, tp=world, pp=1, ep=1, cp=1, overrides={})
    model = build_gpt_model(mc, tcfg, vocab_size_padded=padded_vocab_size(mc.arch.vocab_size, world))
    summary = load_hf_checkpoint(model, mc, ckpt_dir)
    # bf16 as the sync exports (SyncOptions.dtype); megatron keeps its norms in fp32
    loaded = {n: t.cpu().clone() for n, t in mcore_to_hf(mc, model, dtype=torch.bfloat16)}

    plan = WeightSyncPlan(fp8_block=(128, 128)) if args.fp8_dir else WeightSyncPlan(int4_group=args.group)
    opts = SyncOptions.from_plan(plan, dtype=torch.bfloat16, quantizer=quantized_export(plan, ckpt_dir))
    pub = SyncPublisher(None, mc, None, api_key=None, opts=opts, weights_dir=out / "weights")  # type: ignore[arg-type]
    sync = [(n, t.cpu().clone()) for n, t in pub.stream(model)]
    export_hf(mc, model, out / "disk", hf_dir=ckpt_dir, dtype=torch.bfloat16, quantizer=opts.quantizer)
    export_hf(mc, model, out / "plain", hf_dir=ckpt_dir, dtype=torch.bfloat16)
    if rank == 0:
        save_file(loaded, str(out / "loaded.safetensors"))
        save_file(dict(sync), str(out / "sync.safetensors"))
        (out / "sync_order.json").write_text(json.dumps([n for n, _ in sync]))
        (out / "summary.json").write_text(json.dumps({"tp": world, **summary}))
    ps.destroy_model_parallel()  # the next worker of a chain (chain_worker.py) starts its own
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from rlslurm.exit_guard import skip_final_gc_at_exit

    skip_final_gc_at_exit()  # the product roles' exit: seconds of a core saved per torchrun worker
    sys.path.insert(0, os.getcwd())
    main()
