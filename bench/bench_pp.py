"""Model-parallel layout check on GPUs: one RL rollout at PP=1 and at PP=N (NCCL) from the same HF
weights and batch gives the same losses, metrics and updated weights; with `--moe`, a Qwen3-MoE
shaped model at EP=2 combined with TP=2 or PP=2 against EP=1 (alltoall dispatcher over NCCL).

Not a throughput benchmark: the CPU tests (tests/trainer/test_trainer_pp.py) prove the same on
gloo; this runs megatron's 1F1B schedule over NCCL (batched p2p, variable shapes exchanged
between stages) on a mid-size Qwen3-shaped model with tied embeddings, fp32 (so that equality is
tight), micro-batches of unequal lengths, KL loss against a reference and an entropy bonus.

    python bench/bench_pp.py make-hf DIR [--tiny]
    torchrun --nproc_per_node 1 bench/bench_pp.py run --hf DIR --pp 1 --out pp1.json [--cpu]
    torchrun --nproc_per_node 2 bench/bench_pp.py run --hf DIR --pp 2 --out pp2.json [--cpu]
    python bench/bench_pp.py compare pp1.json pp2.json     # prints one JSON line, exit 1 if they differ
    python bench/bench_pp.py make-hf DIR --moe; torchrun --nproc_per_node 4 bench/bench_pp.py run --hf DIR
        --tp 2 --ep 2 --out ep2tp2.json                      # and compare against --ep 1 on 1 GPU
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL = """
name: qwen3-pp-check
hf_architecture: Qwen3ForCausalLM
hf_model_type: qwen3
arch:
  num_layers: 8
  hidden_size: 1024
  ffn_hidden_size: 3072
  num_attention_heads: 16
  num_query_groups: 8
  kv_channels: 64
  vocab_size: 151936
  max_position_embeddings: 4096
  norm_epsilon: 1.0e-6
  rotary_base: 1000000
  qk_layernorm: true
  tie_word_embeddings: true
"""
# The MoE check model: the dense one at half the depth, untied, with routed experts in every layer.
MOE_CHANGES = {
    "name": "qwen3-moe-ep-check", "hf_architecture": "Qwen3MoeForCausalLM", "hf_model_type": "qwen3_moe",
    "arch": {"num_layers": 4, "tie_word_embeddings": False,
             "moe": {"num_experts": 8, "router_topk": 2, "moe_ffn_hidden_size": 768,
                     "router_score_function": "softmax", "router_topk_norm": True}},
}
COMPARED = ("loss", "pg_loss", "kl", "entropy", "ppo_kl", "grad_norm")


def _model_file(kind: str) -> str:
    if kind == "tiny":
        return "tiny-qwen3"
    import yaml

    model = yaml.safe_load(MODEL)
    if kind == "moe":
        model.update({k: v for k, v in MOE_CHANGES.items() if k != "arch"})
        model["arch"].update(MOE_CHANGES["arch"])
    path = Path(tempfile.gettempdir()) / f"{model['name']}.yaml"
    path.write_text(yaml.safe_dump(model, sort_keys=False))
    return str(path)


def make_hf(out: Path, kind: str) -> None:
    from rlslurm.settings.model_config import load_model_config
    from rlslurm.tiny import make_tiny_checkpoint

    make_tiny_checkpoint(load_model_config(_model_file(kind)), out, seed=11)
    (out / "bench_model.txt").write_text(kind)


def make_rollout(n: int, vocab: int, max_len: int, seed: int = 0):
    """Unequal lengths, so consecutive micro-batches carry activations of different shapes."""
    from rlslurm.buffer import Rollout, RolloutMeta, RolloutStats, Sample

    rng = np.random.default_rng(seed)
    samples = []
    for i in range(n):
        p = int(rng.integers(max_len // 16, max_len // 8))
        r = int(rng.integers(max_len // 4, max_len - p))
        samples.append(Sample(prompt_tokens=rng.integers(0, vocab, p), response_tokens=rng.integers(0, vocab, r),
                              reward=float(rng.integers(0, 2)) + 0.1 * (i % 4),
                              rollout_logprobs=-rng.random(r).astype(np.float32) * 3, group_index=i // 4, index=i))
    return Rollout(rollout_id=0, samples=samples, meta=RolloutMeta(), stats=RolloutStats.of(samples))


def run(a: argparse.Namespace) -> None:
    import torch.distributed as dist

    from rlslurm.convert import mcore_to_hf
    from rlslurm.settings.config import RunConfig
    from rlslurm.trainer import step as steps
    from rlslurm.trainer.pipeline import stages_to_first
    from rlslurm.trainer.setup import build_trainer, init_distributed

    device = "cpu" if a.cpu else "cuda"
    _, world = init_distributed(device, timeout_minutes=10)
    kind = (a.hf / "bench_model.txt").read_text()
    tiny = kind == "tiny"
    tmp = Path(tempfile.mkdtemp())
    cfg = RunConfig.model_validate({
        "run": {"run_dir": str(tmp / "run"), "device": device, "seed": 1},
        "model": {"model": _model_file(kind), "hf_checkpoint": str(a.hf)},
        "rollout": {"num_rollout": 1},
        "train": {"micro_batch_size": 2, "global_batch_size": a.samples // 2, "num_steps_per_rollout": 2,
                  "lr": 1e-5, "bf16": False, "use_distributed_optimizer": False, "clip_grad": 1.0,
                  "pipeline_model_parallel_size": a.pp, "tensor_model_parallel_size": a.tp,
                  "expert_model_parallel_size": a.ep, "use_kl_loss": True, "kl_loss_coef": 0.05,
                  "entropy_coef": 0.01, "adam_eps": 1e-3},
        "megatron": {"batch_p2p_comm": False} if a.no_batch_p2p else {},
    })
    t0 = time.perf_counter()
    st = build_trainer(cfg, world)
    build_s = time.perf_counter() - t0
    rollout = make_rollout(a.samples, st.mc.arch.vocab_size, 64 if tiny else a.max_len)
    t1 = time.perf_counter()
    prep = steps.prepare(st, rollout)
    prep_s = time.perf_counter() - t1
    results, step_s = [], []
    for k in range(2):
        if torch.cuda.is_available() and not a.cpu:
            torch.cuda.synchronize()
        t = time.perf_counter()
        results.append(steps.train_step(st, rollout, prep, k))
        if torch.cuda.is_available() and not a.cpu:
            torch.cuda.synchronize()
        step_s.append(time.perf_counter() - t)
    # A digest of the updated weights (every stage's tensors, gathered on rank 0).
    from megatron.core import parallel_state as ps

    sender = ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0
    digest = {}
    for name, t in stages_to_first(mcore_to_hf(st.mc, st.actor.model), sender=sender):
        x = t.double()
        digest[name] = [float(x.sum()), float(x.abs().sum()), float(x.norm())]
    if dist.get_rank() == 0:
        import megatron.core

        out = {"pp": a.pp, "tp": a.tp, "ep": a.ep, "model": kind, "world": world,
               "batch_p2p_comm": st.tcfg.batch_p2p_comm, "steps": results,
               "digest": digest, "build_s": round(build_s, 1), "prepare_s": round(prep_s, 3),
               "step_s": [round(x, 3) for x in step_s],
               "microbatches": [len(s) for s in prep.plan.steps],
               "tokens": sum(len(s.tokens) for s in rollout.samples),
               "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() and not a.cpu else "cpu",
               "megatron_core": getattr(megatron.core, "__version__", "?"), "torch": torch.__version__,
               "params_stage0": sum(p.numel() for p in st.actor.model.parameters())}
        a.out.write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def compare(a_path: Path, b_path: Path) -> int:
    a, b = json.loads(a_path.read_text()), json.loads(b_path.read_text())
    # The test tolerances (rel 1e-5 with an absolute floor of 1e-6): pg_loss, kl and ppo_kl are
    # means of near-cancelling terms (~1e-6 .. 1e-11 here), where a relative measure is noise. On
    # GPUs fp32 kernels are not bit-reproducible between runs, so exact equality is not expected.
    pairs = [(x[k], y[k]) for x, y in zip(a["steps"], b["steps"]) for k in COMPARED]
    metric_excess = max(abs(u - v) - (1e-5 * abs(u) + 1e-6) for u, v in pairs)
    worst_metric = max(abs(u - v) / max(abs(u), 1e-6) for u, v in pairs)
    worst_weight = max(abs(u - v) / max(abs(u), 1e-6)
                       for n in a["digest"] for u, v in zip(a["digest"][n], b["digest"][n]))
    ok = set(a["digest"]) == set(b["digest"]) and metric_excess <= 0 and worst_weight < 1e-5
    print(json.dumps({
        "check": "rl_step_pp_equals_pp1" if b.get("model", "mid") != "moe" else "rl_step_moe_layout_equals_ep1",
        "ok": ok, "pp": [a["pp"], b["pp"]], "tp": [a.get("tp", 1), b.get("tp", 1)],
        "ep": [a.get("ep", 1), b.get("ep", 1)],
        "gpu": b["gpu"],
        "megatron_core": b["megatron_core"], "torch": b["torch"],
        "losses": {k: [[s[k] for s in a["steps"]], [s[k] for s in b["steps"]]] for k in COMPARED},
        "max_abs_metric_diff": max(abs(u - v) for u, v in pairs),
        "max_rel_metric_diff": worst_metric, "max_rel_weight_digest_diff": worst_weight,
        "tensors": [len(a["digest"]), len(b["digest"])], "microbatches": b["microbatches"], "tokens": b["tokens"],
        "step_s": [a["step_s"], b["step_s"]], "prepare_s": [a["prepare_s"], b["prepare_s"]],
        "build_s": [a["build_s"], b["build_s"]],
    }))
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-hf")
    m.add_argument("dir", type=Path)
    m.add_argument("--tiny", action="store_true")
    m.add_argument("--moe", action="store_true", help="the Qwen3-MoE shaped model (for --ep)")
    r = sub.add_parser("run")
    r.add_argument("--hf", type=Path, required=True)
    r.add_argument("--pp", type=int, default=1)
    r.add_argument("--tp", type=int, default=1)
    r.add_argument("--ep", type=int, default=1)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--samples", type=int, default=16)
    r.add_argument("--max-len", type=int, default=1024)
    r.add_argument("--cpu", action="store_true")
    r.add_argument("--no-batch-p2p", action="store_true", help="megatron's non-batched p2p path instead")
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    a = ap.parse_args()
    if a.cmd == "make-hf":
        make_hf(a.dir, "tiny" if a.tiny else "moe" if a.moe else "mid")
        return 0
    if a.cmd == "run":
        run(a)
        return 0
    return compare(a.a, a.b)


if __name__ == "__main__":
    sys.exit(main())
