"""Trainer throughput: the RL optimizer step vs a plain Megatron forward+backward+step, same run.

Both run on the same model, optimizer and micro-batches (random-init, real architecture,
qwen3-1.7B shape by default, bf16, one GPU):

- reference: `model(tokens, labels=...)` -> mean token loss -> backward -> finalize grads -> step,
  i.e. megatron's own fused vocab-parallel cross entropy, nothing RL;
- figure: `rlslurm.trainer.step.train_step` (RL loss with old/ref log-probs prepared, entropy
  metric, metrics reduction) over the same micro-batches.

The old-log-prob recompute (a no-grad forward, `prepare`) is measured separately and reported as
well, with the ratio of a whole rollout (recompute + step) to the plain step. Iterations of the
two alternate after warm-up, the median is reported. Prints one JSON line.

    python bench/bench_trainer.py                 # GPU, qwen3-1.7B shape
    python bench/bench_trainer.py --tiny --cpu    # smoke test of the script (tiny model, CPU)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QWEN3_1_7B = """
name: qwen3-1.7B-bench
hf_architecture: Qwen3ForCausalLM
hf_model_type: qwen3
arch:
  num_layers: {layers}
  hidden_size: 2048
  ffn_hidden_size: 6144
  num_attention_heads: 16
  num_query_groups: 8
  kv_channels: 128
  vocab_size: 151936
  max_position_embeddings: 40960
  norm_epsilon: 1.0e-6
  rotary_base: 1000000
  qk_layernorm: true
  tie_word_embeddings: true
"""


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_rollout(n: int, seq: int, prompt: int, vocab: int, seed: int = 0):
    from rlslurm.buffer import Rollout, RolloutMeta, RolloutStats, Sample

    rng = np.random.default_rng(seed)
    samples = [Sample(prompt_tokens=rng.integers(0, vocab, prompt),
                      response_tokens=rng.integers(0, vocab, seq - prompt),
                      reward=float(rng.integers(0, 2)), rollout_logprobs=-rng.random(seq - prompt).astype(np.float32),
                      group_index=i // 4, index=i) for i in range(n)]
    return Rollout(rollout_id=0, samples=samples, meta=RolloutMeta(), stats=RolloutStats.of(samples))


def plain_step(st, rollout, plan_step) -> None:
    """The reference: megatron's own LM loss, nothing RL."""
    from megatron.core.distributed import finalize_model_grads

    from rlslurm.trainer.batching import collate, collate_packed
    from rlslurm.trainer.logprobs import model_inputs

    tr = st.actor
    tr.model.zero_grad_buffer()
    tr.optimizer.zero_grad()
    n_tok = sum(len(rollout.samples[i].tokens) for mb in plan_step for i in mb)
    packed = st.cfg.train.qkv_format == "thd"
    for idx in plan_step:
        # packed as the RL step packs (thd), so both sides run the same attention on the same rows
        mb = (collate_packed if packed else collate)(rollout.samples, idx, st.device)
        tokens, pos, packed_kw = model_inputs(mb)
        labels = torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], dim=1)
        loss = tr.model(tokens, pos, None, labels=labels, **packed_kw)
        (loss.sum() / n_tok).backward()
    finalize_model_grads([tr.model])
    tr.optimizer.step()
    tr.scheduler.step(increment=1)


RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}  # slime's


def bench_trainer(*, tiny: bool, cpu: bool, layers: int, train: dict, model: str | None = None,
                  megatron: dict | None = None):
    """A trainer for a bench: tiny-qwen3 in fp32, or in bf16 the shipped config `model`, or the qwen3-1.7B
    shape with `layers` layers. One process (rank 0 of 1), or each rank of a torchrun (its env names
    the rank and world; `train` sets the parallel layout). Returns (setup, vocab size)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)
    from rlslurm.settings.config import RunConfig
    from rlslurm.trainer.setup import build_trainer, init_distributed

    device = "cpu" if cpu else "cuda"
    init_distributed(device, timeout_minutes=10)
    tmp = Path(tempfile.mkdtemp())
    if tiny:
        model, vocab, bf16 = "tiny-qwen3", 64, False
    elif model is not None:
        from rlslurm.settings.model_config import load_model_config

        vocab, bf16 = load_model_config(model).arch.vocab_size, True
    else:
        (tmp / "qwen3-1.7B-bench.yaml").write_text(QWEN3_1_7B.format(layers=layers))
        model, vocab, bf16 = str(tmp / "qwen3-1.7B-bench.yaml"), 151936, True
    cfg = RunConfig.model_validate({
        "run": {"run_dir": str(tmp / "run"), "device": device, "seed": 1},
        "model": {"model": model},
        "rollout": {"num_rollout": 100},
        "megatron": megatron or {},
        "train": {"num_steps_per_rollout": 1, "lr": 1e-6, "bf16": bf16, "use_distributed_optimizer": True,
                  "clip_grad": 1.0, **train},
    })
    return build_trainer(cfg, int(os.environ["WORLD_SIZE"])), vocab


def model_flops_utilization(st, gpu: str, tokens: int, step_s: dict[str, float], seq: int) -> dict | None:
    """Model FLOPs of each step (bench/flops.py: 3 x forward, dense shape) over the GPUs' bf16 peak; None
    where the peak is not known (CPU) or the model is not dense."""
    from flops import peak_bf16, qwen3_forward_flops_per_token

    from rlslurm.settings.model_config import load_model_config

    arch = load_model_config(st.cfg.model.model).arch
    peak = peak_bf16(gpu)
    if peak is None or getattr(arch, "moe", None) is not None or not st.cfg.train.bf16:
        return None
    flops = 3 * qwen3_forward_flops_per_token(arch, seq) * tokens
    ranks = int(os.environ["WORLD_SIZE"])
    return {k: round(flops / s / (peak * ranks), 4) for k, s in step_s.items()}


def write_profile(path: Path, steps: dict, cuda: bool, rows: int = 30) -> None:
    """Each step once under torch.profiler: its top operators by self device time (CPU time on CPU), so
    that a gap between the two steps can be named by kernel."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    parts = []
    for name, fn in steps.items():
        with profile(activities=acts) as prof:
            wall = fn()
        parts.append(f"== {name}: {wall:.4f} s wall\n" + prof.key_averages().table(sort_by=key, row_limit=rows))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(parts) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--model", default=None, help="a shipped model config (e.g. qwen3-4B) instead of the "
                    "qwen3-1.7B shape of --layers layers")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallelism (run under torchrun with as many ranks)")
    ap.add_argument("--recompute", action="store_true", help="full activation recompute, one layer at a time "
                    "(slime's --recompute-granularity full --recompute-method uniform --recompute-num-layers 1)")
    ap.add_argument("--transformer-impl", choices=("local", "transformer_engine"), default="local",
                    help="the layers the trainer builds (docs/transformer-engine.md)")
    ap.add_argument("--qkv-format", choices=("bshd", "thd"), default="bshd",
                    help="thd: each micro-batch's samples packed (rlslurm's SDPA/flash-varlen core attention, "
                         "without TE), and the plain reference packs the same rows; bshd, the default: padded, the "
                         "core attention of the spec (SDPA without TE)")
    ap.add_argument("--tiny", action="store_true", help="tiny-qwen3 in fp32 (script smoke test)")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--profile", type=Path, default=None,
                    help="after the timed steps, profile one RL and one plain step (torch.profiler) and write "
                         "each one's top operators by device time to this text file")
    a = ap.parse_args()

    from rlslurm.trainer import step as steps

    t0 = time.perf_counter()
    st, vocab = bench_trainer(tiny=a.tiny, cpu=a.cpu, layers=a.layers, model=a.model,
                              megatron=RECOMPUTE if a.recompute else None,
                              train={"micro_batch_size": a.mbs, "global_batch_size": a.samples,
                                     "tensor_model_parallel_size": a.tp, "transformer_impl": a.transformer_impl,
                                     "qkv_format": a.qkv_format})
    build_s = time.perf_counter() - t0
    bf16 = st.cfg.train.bf16
    rollout = make_rollout(a.samples, a.seq, a.prompt, vocab)
    plan = steps.make_plan(st, rollout)
    tokens = a.samples * a.seq

    def rl() -> float:
        _sync()
        t = time.perf_counter()
        steps.train_step(st, rollout, prep, 0)
        _sync()
        return time.perf_counter() - t

    def plain() -> float:
        _sync()
        t = time.perf_counter()
        plain_step(st, rollout, plan.steps[0])
        _sync()
        return time.perf_counter() - t

    def recompute() -> float:
        _sync()
        t = time.perf_counter()
        steps.prepare(st, rollout)
        _sync()
        return time.perf_counter() - t

    prep = steps.prepare(st, rollout)
    for _ in range(a.warmup):
        plain(), rl(), recompute()
    t_plain, t_rl, t_prep = [], [], []
    for _ in range(a.iters):
        t_plain.append(plain())
        t_rl.append(rl())
        t_prep.append(recompute())
    mp, mr, mq = statistics.median(t_plain), statistics.median(t_rl), statistics.median(t_prep)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() and not a.cpu else "cpu"
    mfu = model_flops_utilization(st, gpu, tokens, {"rl": mr, "plain": mp}, a.seq)
    import megatron.core

    res = {
        "bench": "trainer_rl_step_vs_plain_megatron_step",
        "figure": round(tokens / mr, 1),
        "figure_name": "RL train step tokens/s",
        "reference": round(tokens / mp, 1),
        "reference_name": "plain megatron forward+backward+step tokens/s (same batch, same run)",
        "ratio": round(mp / mr, 4),
        "target_ratio": 0.90,
        "rollout_with_recompute_tokens_per_s": round(tokens / (mr + mq), 1),
        "rollout_with_recompute_ratio": round(mp / (mr + mq), 4),
        "old_logprob_recompute_s": round(mq, 4),
        "mfu": mfu,
        "step_s": {"rl": [round(x, 4) for x in t_rl], "plain": [round(x, 4) for x in t_plain]},
        "model": "tiny-qwen3" if a.tiny else (f"{a.model} config, random init" if a.model
                                               else f"qwen3-1.7B shape, {a.layers} layers, random init"),
        "tp": a.tp, "ranks": int(os.environ["WORLD_SIZE"]), "recompute": a.recompute,
        "transformer_impl": a.transformer_impl, "qkv_format": a.qkv_format,
        "params": sum(p.numel() for p in st.actor.model.parameters()),
        "batch": {"samples": a.samples, "seq": a.seq, "prompt": a.prompt, "micro_batch_size": a.mbs, "tokens": tokens},
        "dtype": "bf16" if bf16 else "fp32", "gpu": gpu, "torch": torch.__version__,
        "megatron_core": getattr(megatron.core, "__version__", "?"), "build_s": round(build_s, 1),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if gpu != "cpu" else None,
    }
    line = json.dumps(res)
    if a.profile is not None and int(os.environ["RANK"]) == 0:
        write_profile(a.profile, {"RL step": rl, "plain megatron step": plain}, cuda=gpu != "cpu")
    if int(os.environ["RANK"]) != 0:  # every rank measured the same steps; rank 0 reports
        torch.distributed.destroy_process_group()
        return
    print(line, flush=True)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(line + "\n")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
