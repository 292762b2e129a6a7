"""Weight-sync bandwidth on GPUs: our sender vs a raw broadcast of the same bytes, same run.

Sender (GPU 0, this process): HF-named bf16 tensors of a Qwen3-shaped model, packed by
`rlslurm.trainer.weight_sync.iter_buckets` and broadcast with `rlslurm.trainer.sync_group.SyncGroup`
(the trainer's code, NCCL). Receiver (GPU 1, or GPU 0 with one GPU; a second process): joins the
group the way SGLang's `init_custom_process_group` does (tcp rendezvous, PrefixStore(group_name),
torch's process-group helper) and does what SGLang's `/update_weights_from_distributed` does per
bucket: allocate, one broadcast per tensor, wait, copy each into the HF model built with
transformers from the config, then answer (here over a pipe instead of HTTP).

Modes:
- `sglang`: the sender waits for the bucket's answer before the next bucket (what the trainer's
  `StageSender` does: one HTTP call per bucket, answered after the load);
- `pipelined` (extra figure): bucket i+1 is announced and broadcast as soon as bucket i's
  broadcast has completed, and bucket i's answer awaited after that, so the receiver's copy of i
  overlaps the transfer of i+1 (the receiver is unchanged and still handles buckets in order);
- `flattened` (extra figure): SGLang's `load_format: "flattened_bucket"`: one buffer and one
  broadcast per bucket, views copied into the model;
- `raw`: one flat buffer of the same total bytes, one broadcast, no copy: the reference.

Prints one JSON line per model size: {"figure": GB/s of sglang mode, "reference": raw GB/s,
"ratio": ..., seconds, bytes, gpu, ...}.

    python bench/bench_weight_sync.py --models 1.7B 4B --bucket-mib 512
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {  # Qwen3 dense configs (HF config.json fields)
    "1.7B": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "4B": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
}


def hf_model(size: str, device: str):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**SHAPES[size], max_position_embeddings=4096, torch_dtype="bfloat16")
    with torch.device("meta"):
        m = Qwen3ForCausalLM(cfg)
    return m.to_empty(device=device).to(torch.bfloat16)


def receiver(size: str, port: int, dev: int, conn, group_name: str) -> None:
    torch.cuda.set_device(dev)
    from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper, _world,
                                                    rendezvous)

    model = hf_model(size, f"cuda:{dev}")
    params = dict(model.named_parameters())
    timeout = datetime.timedelta(seconds=300)
    # What SGLang's init_custom_process_group does (sglang/srt/utils/common.py, 0.5.23).
    store, rank, world = next(rendezvous(f"tcp://127.0.0.1:{port}", 1, 2, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world, rank, [], Backend("nccl"), store, group_name=group_name,
                                      backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world)}
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            break
        if msg[0] == "raw":
            buf = torch.empty(msg[1], dtype=torch.uint8, device=f"cuda:{dev}")
            torch.distributed.broadcast(buf, src=0, group=pg)
            torch.cuda.synchronize()
            del buf
            conn.send("ok")
            continue
        _, names, dtypes, shapes = msg[:4]
        if len(msg) > 4:  # load_format "flattened_bucket": one broadcast, then views
            flat = torch.empty(msg[4], dtype=torch.uint8, device=f"cuda:{dev}")
            torch.distributed.broadcast(flat, src=0, group=pg)
            off = 0
            with torch.no_grad():
                for n, dt, sh in zip(names, dtypes, shapes):
                    p = params[n]
                    nb = p.numel() * p.element_size()
                    p.copy_(flat[off:off + nb].view(getattr(torch, dt)).view(sh))
                    off += nb
            torch.cuda.synchronize()
            conn.send("ok")
            continue
        weights, handles = [], []
        for n, dt, sh in zip(names, dtypes, shapes):
            w = torch.empty(sh, dtype=getattr(torch, dt), device=f"cuda:{dev}")
            handles.append(torch.distributed.broadcast(w, src=0, group=pg, async_op=True))
            weights.append((n, w))
        for h in handles:
            h.wait()
        with torch.no_grad():
            for n, w in weights:  # load_weights: copy into the model's parameter
                params[n].copy_(w)
        torch.cuda.synchronize()
        conn.send("ok")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["1.7B", "4B"])
    ap.add_argument("--bucket-mib", type=int, nargs="+", default=[512])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    from rlslurm.net import free_port
    from rlslurm.trainer.sync_group import GroupSpec, SyncGroup
    from rlslurm.trainer.sync_group import iter_buckets

    ngpu = torch.cuda.device_count()
    recv_dev = 1 if ngpu > 1 else 0
    torch.cuda.set_device(0)
    gpu = torch.cuda.get_device_name(0)
    ctx = mp.get_context("spawn")
    lines = []
    for size in a.models:
        sender_model = hf_model(size, "cuda:0")
        named = [(n, p.detach()) for n, p in sender_model.named_parameters()]  # tied: embedding once
        for _, p in named:
            p.normal_()
        total = sum(p.numel() * p.element_size() for _, p in named)
        nparams = sum(p.numel() for _, p in named)
        for bucket_mib in a.bucket_mib:
            port = free_port()
            name = f"bench-{size}-{bucket_mib}"
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=receiver, args=(size, port, recv_dev, child, name))
            proc.start()
            g = SyncGroup(GroupSpec("127.0.0.1", port, 2, name, "nccl", 300.0), device=torch.device("cuda:0")).open()
            g.join()
            assert parent.recv() == "ready"

            def sync_once() -> float:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for bucket in iter_buckets(named, bucket_mib * 1024**2, torch.device("cuda:0")):
                    parent.send(("bucket", [n for n, _ in bucket], [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                                 [list(t.shape) for _, t in bucket]))
                    g.broadcast([t for _, t in bucket])
                    assert parent.recv() == "ok"
                torch.cuda.synchronize()
                return time.perf_counter() - t0

            def pipelined_once() -> float:
                """Bucket i+1 is announced once bucket i's broadcast has completed (the receiver is
                then loading i, so the order of requests is kept); its answer is awaited after."""
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                pending = 0
                for bucket in iter_buckets(named, bucket_mib * 1024**2, torch.device("cuda:0")):
                    parent.send(("bucket", [n for n, _ in bucket], [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                                 [list(t.shape) for _, t in bucket]))
                    g.broadcast([t for _, t in bucket])
                    torch.cuda.current_stream().synchronize()
                    if pending:
                        assert parent.recv() == "ok"
                        pending -= 1
                    pending += 1
                for _ in range(pending):
                    assert parent.recv() == "ok"
                torch.cuda.synchronize()
                return time.perf_counter() - t0

            def flattened_once() -> float:
                """SGLang's load_format="flattened_bucket": the sender packs each bucket into one
                buffer, one broadcast per bucket."""
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for bucket in iter_buckets(named, bucket_mib * 1024**2, torch.device("cuda:0")):
                    buf = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in bucket])
                    parent.send(("bucket", [n for n, _ in bucket], [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                                 [list(t.shape) for _, t in bucket], buf.numel()))
                    g.broadcast([buf])
                    assert parent.recv() == "ok"
                torch.cuda.synchronize()
                return time.perf_counter() - t0

            flat = torch.empty(total, dtype=torch.uint8, device="cuda:0")

            def raw_once() -> float:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                parent.send(("raw", total))
                g.broadcast([flat])
                assert parent.recv() == "ok"
                torch.cuda.synchronize()
                return time.perf_counter() - t0

            sync_once(), raw_once(), pipelined_once(), flattened_once()  # warm-up: NCCL, allocator
            syncs, raws, pipes, flats = [], [], [], []
            for _ in range(a.repeats):  # interleaved, so drift hits all alike
                syncs.append(sync_once())
                raws.append(raw_once())
                pipes.append(pipelined_once())
                flats.append(flattened_once())
            parent.send(None)
            proc.join(timeout=120)
            g.close()
            del flat
            ts, tr, tp, tf = (sorted(x)[len(x) // 2] for x in (syncs, raws, pipes, flats))
            line = {"figure": round(total / ts / 1e9, 2), "figure_unit": "GB/s (weight sync, sglang-like receiver)",
                    "reference": round(total / tr / 1e9, 2), "reference_unit": "GB/s (raw flat broadcast, same bytes)",
                    "ratio": round(tr / ts, 3), "sync_s": round(ts, 4), "raw_s": round(tr, 4),
                    "sync_s_all": [round(x, 4) for x in syncs], "raw_s_all": [round(x, 4) for x in raws],
                    "pipelined_GBps": round(total / tp / 1e9, 2), "pipelined_ratio": round(tr / tp, 3),
                    "pipelined_s": round(tp, 4),
                    "flattened_GBps": round(total / tf / 1e9, 2), "flattened_ratio": round(tr / tf, 3),
                    "flattened_s": round(tf, 4),
                    "model": f"qwen3-{size}-shaped", "params": nparams, "bytes": total, "dtype": "bfloat16",
                    "tensors": len(named), "bucket_mib": bucket_mib, "gpu": gpu, "gpus": ngpu,
                    "receiver_gpu": recv_dev, "backend": "nccl", "torch": torch.__version__}
            print(json.dumps(line), flush=True)
            lines.append(line)
        del sender_model, named
        torch.cuda.empty_cache()
    if a.out:
        Path(a.out).write_text("".join(json.dumps(x) + "\n" for x in lines))


if __name__ == "__main__":
    main()
