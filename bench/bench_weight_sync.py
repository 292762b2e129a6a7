"""Weight-sync bandwidth on GPUs: our sender vs a raw broadcast of the same bytes, same run.

Sender (GPU 0, this process): HF-named bf16 tensors of a Qwen3-shaped model, packed by
`rlslurm.trainer.weights.group.iter_buckets` and broadcast with `rlslurm.trainer.weights.group.SyncGroup`
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
- `double_buffered` (extra figure): what a receiver built to keep the link busy does: all bucket
  headers in one request, each bucket received into one of two flat buffers while the previous
  one is copied into the model on a side stream; the sender packs bucket i+1 while i is in flight
  and never waits per bucket. Its result is checked against the sender's values after the runs;
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


# NCCL on high-priority streams at both ends, so the receiver's copy kernels (side stream) cannot
# hold the SMs the next bucket's receive needs. SGLang 0.5.23 creates its group with default options.
HIGH_PRIORITY = os.environ.get("BENCH_NCCL_HIGH_PRIORITY") == "1"


def hf_model(size: str, device: str):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**SHAPES[size], max_position_embeddings=4096, torch_dtype="bfloat16")
    with torch.device("meta"):
        m = Qwen3ForCausalLM(cfg)
    return m.to_empty(device=device).to(torch.bfloat16)


def double_buffered_receive(metas: list, params: dict, pg, dev: int) -> None:
    """A receiver that overlaps: bucket i+1 is received into the other of two flat buffers (NCCL's
    stream) while bucket i is copied into the model on a side stream. A buffer is reused only after
    its previous copy has finished (an event the NCCL side waits on), so the copy never races the
    receive. This is what SGLang's receiver would need to do to keep the link busy; 0.5.23's handles
    one bucket per request and copies after the receive."""
    cap = max(m[3] for m in metas)
    bufs = [torch.empty(cap, dtype=torch.uint8, device=f"cuda:{dev}") for _ in range(2)]
    copy_stream = torch.cuda.Stream()
    freed: list = [None, None]
    with torch.no_grad():
        for i, (names, dtypes, shapes, nbytes) in enumerate(metas):
            buf = bufs[i % 2][:nbytes]
            if freed[i % 2] is not None:
                torch.cuda.current_stream().wait_event(freed[i % 2])
            torch.distributed.broadcast(buf, src=0, group=pg, async_op=True).wait()  # stream wait, CPU goes on
            got = torch.cuda.Event()
            got.record()
            with torch.cuda.stream(copy_stream):
                copy_stream.wait_event(got)
                off = 0
                for n, dt, sh in zip(names, dtypes, shapes):
                    p = params[n]
                    nb = p.numel() * p.element_size()
                    p.copy_(buf[off:off + nb].view(getattr(torch, dt)).view(sh))
                    off += nb
                done = torch.cuda.Event()
                done.record(copy_stream)
                freed[i % 2] = done
    torch.cuda.synchronize()


def receiver(size: str, port: int, dev: int, conn, group_name: str) -> None:
    torch.cuda.set_device(dev)
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    model = hf_model(size, f"cuda:{dev}")
    params = dict(model.named_parameters())
    timeout = datetime.timedelta(seconds=300)
    # What SGLang's init_custom_process_group does (sglang/srt/utils/common.py, 0.5.23).
    store, rank, world = next(rendezvous(f"tcp://127.0.0.1:{port}", 1, 2, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    opts = None
    if HIGH_PRIORITY:
        opts = torch.distributed.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = True
    pg, _ = _new_process_group_helper(world, rank, [], Backend("nccl"), store, group_name=group_name,
                                      backend_options=opts, timeout=timeout)
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
        if msg[0] == "checksum":  # what the model holds after the last sync, to check the fast paths are right
            conn.send({n: float(p.double().sum()) for n, p in params.items()})
            continue
        if msg[0] == "stream":
            double_buffered_receive(msg[1], params, pg, dev)
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
    from rlslurm.trainer.weights.group import GroupSpec, SyncGroup, iter_buckets

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
            g = SyncGroup(GroupSpec("127.0.0.1", port, 2, name, "nccl", 300.0), device=torch.device("cuda:0"),
                          high_priority=HIGH_PRIORITY).open()
            g.join()
            assert parent.recv() == "ready"

            def sync_once() -> float:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for bucket in iter_buckets(named, bucket_mib * 1024**2, torch.device("cuda:0")):
                    parent.send(("bucket", [n for n, _ in bucket],
                                 [str(t.dtype).removeprefix("torch.") for _, t in bucket],
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
                    parent.send(("bucket", [n for n, _ in bucket],
                                 [str(t.dtype).removeprefix("torch.") for _, t in bucket],
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
                    parent.send(("bucket", [n for n, _ in bucket],
                                 [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                                 [list(t.shape) for _, t in bucket], buf.numel()))
                    g.broadcast([buf])
                    assert parent.recv() == "ok"
                torch.cuda.synchronize()
                return time.perf_counter() - t0

            buckets = list(iter_buckets(named, bucket_mib * 1024**2, torch.device("cuda:0")))
            metas = [([n for n, _ in b], [str(t.dtype).removeprefix("torch.") for _, t in b],
                      [list(t.shape) for _, t in b], sum(t.numel() * t.element_size() for _, t in b))
                     for b in buckets]
            cap = max(m[3] for m in metas)
            send_bufs = [torch.empty(cap, dtype=torch.uint8, device="cuda:0") for _ in range(2)]
            pack_stream = torch.cuda.Stream()

            def double_buffered_once() -> float:
                """All bucket headers in one request; each bucket packed into one of two flat
                buffers on a side stream while the previous one is broadcast; the CPU never waits
                per bucket (the receiver answers once, after its last copy)."""
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                parent.send(("stream", metas))
                sent: list = [None, None]
                for i, b in enumerate(buckets):
                    buf = send_bufs[i % 2][:metas[i][3]]
                    with torch.cuda.stream(pack_stream):
                        if sent[i % 2] is not None:
                            pack_stream.wait_event(sent[i % 2])
                        torch.cat([t.reshape(-1).view(torch.uint8) for _, t in b], out=buf)
                        packed = torch.cuda.Event()
                        packed.record(pack_stream)
                    torch.cuda.current_stream().wait_event(packed)
                    opts = torch.distributed.BroadcastOptions()
                    opts.rootRank, opts.rootTensor = 0, 0
                    g.backend.broadcast([buf], opts).wait()  # the current stream waits; the CPU does not
                    ev = torch.cuda.Event()
                    ev.record()
                    sent[i % 2] = ev
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

            sync_once(), raw_once(), pipelined_once(), flattened_once(), double_buffered_once()  # warm-up
            syncs, raws, pipes, flats, dbs = [], [], [], [], []
            for _ in range(a.repeats):  # interleaved, so drift hits all alike
                syncs.append(sync_once())
                raws.append(raw_once())
                pipes.append(pipelined_once())
                flats.append(flattened_once())
                dbs.append(double_buffered_once())
            for _, p in named:  # fresh values, so a path that skipped a bucket cannot match by leftovers
                p.normal_()
            double_buffered_once()
            parent.send(("checksum",))
            got = parent.recv()
            bad = [n for n, p in named if abs(got[n] - float(p.double().sum())) > 1e-6 * max(1.0, abs(got[n]))]
            assert not bad, f"double-buffered receiver holds wrong values for {bad[:3]}"
            parent.send(None)
            proc.join(timeout=120)
            g.close()
            del flat, send_bufs, buckets
            ts, tr, tp, tf, td = (sorted(x)[len(x) // 2] for x in (syncs, raws, pipes, flats, dbs))
            line = {"figure": round(total / ts / 1e9, 2), "figure_unit": "GB/s (weight sync, sglang-like receiver)",
                    "reference": round(total / tr / 1e9, 2), "reference_unit": "GB/s (raw flat broadcast, same bytes)",
                    "ratio": round(tr / ts, 3), "sync_s": round(ts, 4), "raw_s": round(tr, 4),
                    "sync_s_all": [round(x, 4) for x in syncs], "raw_s_all": [round(x, 4) for x in raws],
                    "pipelined_GBps": round(total / tp / 1e9, 2), "pipelined_ratio": round(tr / tp, 3),
                    "pipelined_s": round(tp, 4),
                    "flattened_GBps": round(total / tf / 1e9, 2), "flattened_ratio": round(tr / tf, 3),
                    "flattened_s": round(tf, 4),
                    "double_buffered_GBps": round(total / td / 1e9, 2), "double_buffered_ratio": round(tr / td, 3),
                    "double_buffered_s": round(td, 4), "double_buffered_s_all": [round(x, 4) for x in dbs],
                    "double_buffered_verified": True, "model": f"qwen3-{size}-shaped", "params": nparams,
                    "bytes": total, "dtype": "bfloat16",
                    "tensors": len(named), "bucket_mib": bucket_mib, "gpu": gpu, "gpus": ngpu,
                    "receiver_gpu": recv_dev, "backend": "nccl", "nccl_high_priority": HIGH_PRIORITY,
                    "torch": torch.__version__}
            print(json.dumps(line), flush=True)
            lines.append(line)
        del sender_model, named
        torch.cuda.empty_cache()
    if a.out:
        Path(a.out).write_text("".join(json.dumps(x) + "\n" for x in lines))


if __name__ == "__main__":
    main()
