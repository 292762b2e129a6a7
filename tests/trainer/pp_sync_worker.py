"""Run under torchrun (gloo, CPU) by test_trainer_pp_weight_sync.py: a real megatron-core GPTModel
split over PP = world size stages, loaded from the tiny HF checkpoint, "trained" (seeded noise on
every parameter), published through `broadcast_publisher` (one weight-update group per stage) to
the real SGLang engines of RUN/control, then probed: the pipelined greedy continuation of the
trainer against every engine's. Twice (versions 1, 2: the second reuses the groups). Rank 0
writes <out>/result.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True, type=Path)
    ap.add_argument("--run-dir", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from rlslurm.models import cpu_shim

    cpu_shim.apply()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rlslurm.buffer.control import Control
    from rlslurm.buffer.rundir import RunDir
    from rlslurm.convert import load_hf_checkpoint
    from rlslurm.engines.greedy import engine_greedy
    from rlslurm.models.build import build_gpt_model, padded_vocab_size, transformer_config
    from rlslurm.settings.model_config import load_model_config
    from rlslurm.trainer.weights.base import SyncOptions
    from rlslurm.trainer.weights.broadcast import broadcast_publisher
    from rlslurm.trainer.weights.probe import PROBE_NEW_TOKENS, probe_prompt, trainer_greedy

    ps.initialize_model_parallel(pipeline_model_parallel_size=world)
    model_parallel_cuda_manual_seed(1234)
    mc = load_model_config("tiny-qwen3")
    tcfg = transformer_config(mc, params_dtype=torch.float32, pp=world, overrides={})
    model = build_gpt_model(mc, tcfg, vocab_size_padded=padded_vocab_size(mc.arch.vocab_size, 1),
                            pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    model.eval()
    load_hf_checkpoint(model, mc, a.hf)
    rd = RunDir(a.run_dir)
    control = Control(rd)
    pub = broadcast_publisher(mc, control, api_key=rd.api_key(), opts=SyncOptions(timeout_s=240, attempts=1),
                               fallback=None, attempt=0, host="127.0.0.1")
    prompt = probe_prompt(mc.arch.vocab_size)
    before = trainer_greedy(model, prompt, mc.arch.vocab_size)
    results = []
    for v in (1, 2):
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                g = torch.Generator().manual_seed(1000 * v + 100 * ps.get_pipeline_model_parallel_rank() + i)
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
        pub.publish(model, v)
        mine = trainer_greedy(model, prompt, mc.arch.vocab_size)
        if rank == 0:
            urls = [e.url for e in control.engines() if e.healthy]
            results.append({"version": v, "trainer": mine,
                            "engines": engine_greedy(urls, rd.api_key(), prompt, PROBE_NEW_TOKENS),
                            "history": pub.deliveries[-1].as_dict(), "recorded": control.weight_version().version,
                            "recorded_transport": control.weight_version().transport})
    pub.close()
    if rank == 0:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "result.json").write_text(json.dumps({"before": before, "versions": results}, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from rlslurm.exit_guard import skip_final_gc_at_exit

    skip_final_gc_at_exit()  # the product roles' exit: seconds of a core saved per torchrun worker
    main()
