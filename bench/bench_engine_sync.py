"""Weight sync into a real SGLang engine: the trainer's publisher vs a raw broadcast of the same bytes.

Figure: `rlslurm.trainer.weights.broadcast.broadcast_publisher(...).publish` — the trainer's own sender, with
the Megatron export replaced by HF-named bf16 tensors of a Qwen3-shaped model already on GPU 0 — into
one real SGLang engine on GPU 1 started by rlslurm's `EngineSupervisor` behind the real router
(`--load-format dummy`, so no checkpoint is read; the engine's receiver is SGLang's stock
`/update_weights_from_distributed`). Two numbers per sync: `send_s`, the bucket stream (HTTP header
per bucket, NCCL broadcast, engine answers after its load), and `publish_s`, the whole bracket the
trainer pays (update record, pause, send, version, continue).

Each bucket size runs in each of `--modes`: `rlslurm` (`--update-weight-receiver rlslurm`: rlslurm's
receiver inside the engine, engines/receiver.py: one request per publish, buckets received into two
alternating buffers and copied by the copies it learnt; the first two syncs, untimed, fix the
layout and learn the copies), `flattened` (`--update-weight-flattened-bucket`: one broadcast per
bucket, SGLang's `load_format: flattened_bucket`) and `per_tensor` (one broadcast per tensor, SGLang's
default receive).

Reference, same run, interleaved with the figure: one NCCL broadcast of a flat buffer of the same
total bytes from GPU 0 to a plain receiver process on GPU 1 (no HTTP, no copy).

Correctness, after the timed syncs: weights A (seed 1), then B (seed 2), then A again are published
and the engine's greedy answer to fixed prompts is read after each: A and A again must agree and
differ from B (a sync that dropped or misplaced a bucket leaves A' != A).

`--device cpu --models tiny` runs the same path on SGLang's CPU engine with gloo (a check of the
bench itself, no figure worth quoting).

    python3 bench/bench_engine_sync.py --models 1.7B 4B --bucket-mib 512 1024 --repeats 5 --out FILE
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing as mp
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.gpu.bundle_flags import mem_flags, server_flags  # noqa: E402

SHAPES = {  # Qwen3 dense configs (HF config.json fields); "tiny" only checks the bench on CPU
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True),
    "1.7B": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "4B": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
}
MOE_SHAPES = {  # Qwen3-MoE configs (HF config.json fields); "tiny-moe" only checks the bench on CPU
    "tiny-moe": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                     num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, vocab_size=512, tie_word_embeddings=False),
    # Qwen/Qwen3-30B-A3B's config.json: 30.5 B parameters, 61 GB in bf16
    "30B-A3B": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                    num_experts_per_tok=8, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                    head_dim=128, vocab_size=151936, tie_word_embeddings=False),
}
GPU_ENGINE_FLAGS = server_flags()  # the trimmed GPU bundle's (tests/gpu/bundle_flags.py); tests/gpu and
# bench_rollout_overhead.py start their engines with it (this bench takes --mem-fraction)
MODES = {"rlslurm": "rlslurm's receiver in the engine", "flattened": "SGLang's flattened_bucket receive",
         "per_tensor": "SGLang's per-tensor receive"}
PROMPTS = [[1, 17, 42, 99, 7], [1, 300, 5, 5, 5, 12], [1, 64, 65, 66], [1, 2000 % 512, 3, 4, 250]]


def write_model_dir(size: str, out: Path, dtype: str) -> Path:
    from transformers import Qwen3Config, Qwen3MoeConfig

    if size in MOE_SHAPES:
        cfg = Qwen3MoeConfig(**MOE_SHAPES[size], max_position_embeddings=4096, architectures=["Qwen3MoeForCausalLM"],
                             bos_token_id=1, eos_token_id=2, pad_token_id=0, norm_topk_prob=True,
                             decoder_sparse_step=1, mlp_only_layers=[])
    else:
        cfg = Qwen3Config(**SHAPES[size], max_position_embeddings=4096, architectures=["Qwen3ForCausalLM"],
                          bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg.torch_dtype = dtype
    cfg.save_pretrained(out)
    return out


def hf_tensors(size: str, device: torch.device, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """The HF-named parameters of a Qwen3-shaped model (tied embedding once), as the export yields them."""
    if size in MOE_SHAPES:
        return moe_tensors(MOE_SHAPES[size], device, dtype)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with torch.device("meta"):
        m = Qwen3ForCausalLM(Qwen3Config(**SHAPES[size], max_position_embeddings=4096))
    m = m.to_empty(device=device).to(dtype)
    return [(n, p.detach()) for n, p in m.named_parameters()]


def moe_tensors(c: dict, device: torch.device, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """A Qwen3-MoE checkpoint's tensors by their HF checkpoint names, one per expert matrix, in the order
    rlslurm's export yields them (convert/export.py: layer by layer). Written out rather than taken from
    transformers' module, whose 5.x MoE keeps the experts fused in 3-D parameters of other names."""
    h, hd, e, i = c["hidden_size"], c["head_dim"], c["num_experts"], c["moe_intermediate_size"]
    shapes = [("model.embed_tokens.weight", (c["vocab_size"], h))]
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                   (p + "self_attn.q_proj.weight", (c["num_attention_heads"] * hd, h)),
                   (p + "self_attn.k_proj.weight", (c["num_key_value_heads"] * hd, h)),
                   (p + "self_attn.v_proj.weight", (c["num_key_value_heads"] * hd, h)),
                   (p + "self_attn.o_proj.weight", (h, c["num_attention_heads"] * hd)),
                   (p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,)),
                   (p + "mlp.gate.weight", (e, h))]
        for x in range(e):
            q = f"{p}mlp.experts.{x}."
            shapes += [(q + "gate_proj.weight", (i, h)), (q + "up_proj.weight", (i, h)),
                       (q + "down_proj.weight", (h, i))]
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (c["vocab_size"], h))]
    return [(n, torch.empty(shape, device=device, dtype=dtype)) for n, shape in shapes]


def fill(named: list[tuple[str, torch.Tensor]], seed: int) -> None:
    """Values a forward can run on (norms near 1, matrices small), reproducible from `seed`."""
    g = torch.Generator(device=named[0][1].device).manual_seed(seed)
    with torch.no_grad():
        for _, t in named:
            if t.dim() == 1:
                t.copy_(1.0 + 0.1 * torch.randn(t.shape, generator=g, device=t.device, dtype=torch.float32))
            else:
                t.copy_(0.02 * torch.randn(t.shape, generator=g, device=t.device, dtype=torch.float32))


def raw_receiver(port: int, group_name: str, device: str, backend: str, rank: int, world: int, chunk: int,
                 conn) -> None:
    """Joins the way an engine rank does (tcp rendezvous, PrefixStore(group_name), torch's helper) and
    receives each request's bytes as broadcasts of `chunk` bytes into one buffer: the reference's other
    end (one buffer of a 61 GB model would not fit beside the engine)."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    timeout = datetime.timedelta(seconds=300)
    store, rank, world = next(rendezvous(f"tcp://127.0.0.1:{port}", rank, world, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(world, rank, [], Backend(backend), PrefixStore(group_name, store),
                                      group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world)}
    buf = torch.empty(chunk, dtype=torch.uint8, device=device)
    conn.send("ready")
    while (n := conn.recv()) is not None:
        for at in range(0, n, chunk):
            torch.distributed.broadcast(buf[:min(chunk, n - at)], src=0, group=pg)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        conn.send("ok")


async def greedy(url: str, key: str) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their log-probs for PROMPTS. The log-probs carry the check: a random-init
    model with tied embeddings tends to repeat its input token whatever its other weights are."""
    from rlslurm.engines.sglang_client import SGLangClient

    async with SGLangClient(url, key) as c:
        outs = await asyncio.gather(*[c.generate(p, {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True})
                                      for p in PROMPTS])
    return [(list(o["output_ids"]), [float(x[0]) for x in o["meta_info"]["output_token_logprobs"]]) for o in outs]


def max_logprob_diff(x: list, y: list) -> float:
    """inf where the tokens differ, else the largest log-prob difference."""
    if [t for t, _ in x] != [t for t, _ in y]:
        return float("inf")
    return max(abs(p - q) for (_, lx), (_, ly) in zip(x, y) for p, q in zip(lx, ly))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["1.7B", "4B"], choices=sorted(SHAPES) + sorted(MOE_SHAPES))
    ap.add_argument("--engine-tp", type=int, default=1, help="the engine's TP size (its GPUs follow the sender's)")
    ap.add_argument("--engine-gpu", type=int, default=1, help="the engine's first GPU (the sender has GPU 0)")
    ap.add_argument("--mem-fraction", type=float, default=None,
                    help="the engine's --mem-fraction-static (default: SGLang's)")
    ap.add_argument("--bucket-mib", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    a = ap.parse_args()

    from rlslurm.buffer.control import Control
    from rlslurm.buffer.rundir import RunDir
    from rlslurm.engines.engine import EngineSpec
    from rlslurm.engines.receiver import LOADER as RECEIVER_LOADER
    from rlslurm.engines.router import RouterProcess
    from rlslurm.engines.sglang_versions import installed_sglang_version
    from rlslurm.engines.supervisor import EngineSupervisor, control_publisher
    from rlslurm.net import engine_port_block, free_port
    from rlslurm.trainer.weights import group as sync_group
    from rlslurm.trainer.weights.base import Roles, SyncOptions
    from rlslurm.trainer.weights.broadcast import broadcast_publisher

    cuda = a.device == "cuda"
    default_poll = sync_group.POLL_MAX_S  # the product's (a 1 ms cap measured the same: engine-sync-h100x2.md)
    # What the trainer sets (trainer/setup.py, docs/gpu.md): SGLang's engines run with cuMem off.
    os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
    backend = "nccl" if cuda else "gloo"
    send_dev = torch.device("cuda:0") if cuda else torch.device("cpu")
    recv_gpu = a.engine_gpu if cuda else 0
    if cuda:
        torch.cuda.set_device(0)
        if recv_gpu == 0 or recv_gpu + a.engine_tp > torch.cuda.device_count():
            sys.exit(f"bench_engine_sync: the sender needs GPU 0 and the engine GPUs "
                     f"{recv_gpu}..{recv_gpu + a.engine_tp - 1} "
                     f"of the {torch.cuda.device_count()} here (NCCL refuses two ranks of one group on one GPU)")
    dtype = torch.bfloat16 if cuda else torch.float32
    host, key = "127.0.0.1", secrets.token_urlsafe(24)
    mpctx = mp.get_context("spawn")
    lines = []
    for size in a.models:
        work = Path(tempfile.mkdtemp(prefix=f"rlslurm-bench-esync-{size}-"))
        model_dir = write_model_dir(size, work / "model", "bfloat16" if cuda else "float32")
        control = Control(RunDir.create(work / "run"))
        port = engine_port_block(host, 1)[0]
        extra = ("--load-format", "dummy", "--skip-tokenizer-init", "--custom-weight-loader", RECEIVER_LOADER) \
            + ((*server_flags(), *mem_flags(a.mem_fraction)) if cuda else ())
        spec = EngineSpec(name="engine-0", model_path=str(model_dir), host=host, port=port.port,
                          nccl_port=port.nccl_port, log_path=work / "engine-0.log", api_key=key,
                          dtype="bfloat16" if cuda else "float32", device=a.device, base_gpu_id=recv_gpu,
                          tp_size=a.engine_tp,
                          extra_args=extra, cpu_core=None if cuda else 0, max_total_tokens=None if cuda else 8192)
        router = RouterProcess(host=host, port=free_port(host), log_path=work / "router.log", api_key=key,
                               extra_args=("--log-level", "warn"))
        router.start()
        sup = EngineSupervisor([spec], router, health_interval_s=30.0, on_change=control_publisher(control, "bench"))
        named = hf_tensors(size, send_dev, dtype)
        total = sum(t.numel() * t.element_size() for _, t in named)
        try:
            t0 = time.perf_counter()
            sup.start()
            startup_s = time.perf_counter() - t0
            for bucket_mib in a.bucket_mib:
                for mode in a.modes:
                    lines.append(one_setting(a, size, bucket_mib, default_poll, named, total, control, key, host,
                                             backend, send_dev, recv_gpu, mpctx, sup, startup_s,
                                             installed_sglang_version(), broadcast_publisher, SyncOptions, Roles,
                                             mode, spec.log_path))
                    print(json.dumps(lines[-1]), flush=True)
                    if a.out:  # line by line: a run cut short keeps what it measured
                        a.out.parent.mkdir(parents=True, exist_ok=True)
                        with open(a.out, "a") as fh:
                            fh.write(json.dumps(lines[-1]) + "\n")
        finally:
            sup.close()
            router.close()
        del named
        if cuda:
            torch.cuda.empty_cache()


def receiver_lines(log_path: Path) -> dict:
    """What rlslurm's receiver said in the engine's log: how each bucket layout is copied (learnt copies,
    or SGLang's load_weights kept, with why), counted per kind, and its last per-request line."""
    text = Path(log_path).read_text(errors="replace").splitlines()
    lines = [ln[ln.index("rlslurm receiver:"):] for ln in text if "rlslurm receiver:" in ln]
    learnt = [ln for ln in lines if "learnt copies" in ln]
    kept = [ln for ln in lines if "keeps SGLang's load_weights" in ln]
    return {"layouts_learnt": len(learnt), "layouts_kept_load_weights": len(kept), "kept_why": sorted(set(
        ln.split("load_weights: ", 1)[1] for ln in kept))[:3], "last_request": lines[-1] if lines else None}


def one_setting(a, size, bucket_mib, poll_max, named, total, control, key, host, backend, send_dev, recv_gpu,
                mpctx, sup, startup_s, sglang_version, broadcast_publisher, SyncOptions, Roles,
                mode: str, engine_log: Path) -> dict:
    from rlslurm.net import free_port
    from rlslurm.trainer.weights.group import GroupSpec, SyncGroup

    cuda = send_dev.type == "cuda"
    flattened = mode != "per_tensor"
    opts = SyncOptions(bucket_bytes=bucket_mib * 1024**2, backend=backend, timeout_s=300.0,
                       group_prefix=f"bench-{size}-{bucket_mib}-{mode}", flattened=flattened,
                       receiver="rlslurm" if mode == "rlslurm" else "sglang")
    roles = Roles(exporter=True, leader=True, coordinator=True, stage=0, stages=1, device=send_dev)
    # one attempt number per setting: a publisher records its group's rendezvous once per attempt
    pub = broadcast_publisher(None, control, api_key=key, opts=opts, host=host, roles=lambda: roles,
                               attempt=len(list(control.dir.glob("rendezvous-*.json"))),
                               export=lambda mc, model, dt: iter(named))
    # the reference's pair: a plain receiver on the engine's GPU, its own group
    rport, rname = free_port(host), f"bench-raw-{size}-{bucket_mib}-{mode}"
    chunk, tp = bucket_mib * 1024**2, a.engine_tp
    pipes, procs = [], []
    for r in range(tp):  # one plain receiver per engine rank, on that rank's GPU
        parent, child = mpctx.Pipe()
        recv_device = f"cuda:{recv_gpu + r}" if cuda else "cpu"
        procs.append(mpctx.Process(target=raw_receiver,
                                   args=(rport, rname, recv_device, backend, 1 + r, 1 + tp, chunk, child)))
        procs[-1].start()
        pipes.append(parent)
    raw_group = SyncGroup(GroupSpec(host, rport, 1 + tp, rname, backend, 300.0), device=send_dev).open()
    raw_group.join()
    assert all(p.recv() == "ready" for p in pipes)
    flat = torch.empty(chunk, dtype=torch.uint8, device=send_dev)
    version = 0

    def sync_once() -> tuple[float, float]:
        nonlocal version
        version += 1
        pub.publish(None, version)
        h = pub.deliveries[-1]
        assert h.transport == backend and not h.fallback and h.tries == 1, h
        return pub.sender.last.seconds, h.seconds

    def raw_once() -> float:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for p in pipes:
            p.send(total)
        for at in range(0, total, chunk):
            raw_group.broadcast([flat[:min(chunk, total - at)]])
        assert all(p.recv() == "ok" for p in pipes)
        return time.perf_counter() - t0

    try:
        fill(named, 0)
        sync_once(), raw_once()  # warm-up: group built, NCCL connected, buffers allocated
        if mode == "rlslurm":
            sync_once()  # the first planned sync learns the copies; the timed ones replay them
        sends, pubs, raws = [], [], []
        for _ in range(a.repeats):  # interleaved, so drift hits both alike
            s, p = sync_once()
            sends.append(s)
            pubs.append(p)
            raws.append(raw_once())
        answers = []
        for seed in (1, 2, 1):
            fill(named, seed)
            sync_once()
            answers.append(asyncio.run(greedy(sup.urls[0], key)))
        a_again, a_b = max_logprob_diff(answers[0], answers[2]), max_logprob_diff(answers[0], answers[1])
        if not (a_again <= 1e-3 < a_b):
            raise SystemExit(f"bench_engine_sync: the engine's greedy answers do not follow the synced weights "
                             f"(max |logprob| diff: A vs A again {a_again:g}, must be <= 1e-3; A vs B {a_b:g}, "
                             f"must be > 1e-3)")
    finally:
        pub.close()
        for p in pipes:
            p.send(None)
        for proc in procs:
            proc.join(timeout=60)
        raw_group.close()
    med = statistics.median
    ts, tp, tr = med(sends), med(pubs), med(raws)
    gpu = torch.cuda.get_device_name(0) if cuda else "cpu"
    return {
        "bench": "engine_sync", "figure": round(total / ts / 1e9, 2),
        "figure_unit": f"GB/s, the broadcast publisher's send into a real SGLang engine ({MODES[mode]})",
        "reference": round(total / tr / 1e9, 2), "reference_unit": "GB/s, raw flat broadcast of the same bytes",
        "ratio": round(tr / ts, 3), "target_ratio": 0.9, "publish_ratio": round(tr / tp, 3),
        "send_s": round(ts, 4), "publish_s": round(tp, 4), "raw_s": round(tr, 4),
        "send_s_all": [round(x, 4) for x in sends], "publish_s_all": [round(x, 4) for x in pubs],
        "raw_s_all": [round(x, 4) for x in raws],
        "greedy_A_vs_A_again_max_logprob_diff": a_again, "greedy_A_vs_B_max_logprob_diff": a_b,
        "model": f"qwen3-{size}-shaped", "engine_tp": a.engine_tp,
        "receiver_lines": receiver_lines(engine_log) if mode == "rlslurm" else None, "bytes": total,
        "tensors": len(named), "dtype": str(named[0][1].dtype),
        "bucket_mib": bucket_mib, "mode": mode, "flattened_bucket": flattened, "poll_max_s": poll_max,
        "backend": backend, "gpu": gpu,
        "gpus": torch.cuda.device_count() if cuda else 0, "engine_gpus": list(range(recv_gpu, recv_gpu + a.engine_tp)),
        "sglang": sglang_version,
        "engine_startup_s": round(startup_s, 1), "torch": torch.__version__,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


if __name__ == "__main__":
    main()
