"""Trainer side of tests/weight_sync/test_weight_sync_engines.py, run under torchrun (gloo, CPU):
a real megatron-core GPTModel (TP = world size) loaded from the tiny HF checkpoint publishes its
weights through `broadcast_publisher` (trainer/weights/) to the real SGLang engines listed in RUN/control.

The test drives it step by step: before version v it writes `<out>/go-<v>.json`; the worker "trains" (adds seeded noise
to every parameter shard), publishes v, computes its own greedy continuation of the probe prompt with the new weights,
and rank 0 writes `<out>/done-<v>.json`. `{"stop": true}` ends it. `{"break_transfer": true}`: every try of
that version fails on rank 0 after its export and before it hands the engine anything, so the fallback
delivers it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist


def wait_go(out: Path, v: int, rank: int) -> dict:
    msg: list = [None]
    if rank == 0:
        path = out / f"go-{v}.json"
        deadline = time.monotonic() + 600
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} never came")
            time.sleep(0.2)
        msg[0] = json.loads(path.read_text())
    dist.broadcast_object_list(msg, src=0)
    return msg[0]


def greedy(model, mc, prompt: list[int], n: int) -> list[int]:
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            x = torch.tensor([ids])
            pos = torch.arange(len(ids)).unsqueeze(0)
            logits = gather_from_tensor_model_parallel_region(model(x, pos, None))[..., : mc.arch.vocab_size]
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompt", required=True, help="JSON list of token ids")
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--timeout-s", type=float, required=True)
    ap.add_argument("--attempts", type=int, default=2)
    ap.add_argument("--bucket-bytes", type=int, default=64 * 1024)
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
    from rlslurm.models.build import build_gpt_model, padded_vocab_size, transformer_config
    from rlslurm.settings.model_config import load_model_config
    from rlslurm.trainer.weights.base import SyncOptions, WeightSyncError
    from rlslurm.trainer.weights.broadcast import broadcast_publisher
    from rlslurm.trainer.weights.disk import DiskPublisher
    from rlslurm.trainer.weights.ipc import ipc_publisher

    out = Path(a.out)
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    model_parallel_cuda_manual_seed(1234)
    mc = load_model_config("tiny-qwen3")
    tcfg = transformer_config(mc, params_dtype=torch.float32, tp=world, pp=1, ep=1, cp=1, overrides={})
    model = build_gpt_model(mc, tcfg, vocab_size_padded=padded_vocab_size(mc.arch.vocab_size, world))
    model.eval()
    load_hf_checkpoint(model, mc, Path(a.hf))
    rd = RunDir(a.run_dir)
    control = Control(rd)
    prompt = json.loads(a.prompt)
    # One publisher for the whole run, like the trainer's: it keeps its group between versions.
    # rlslurm's receiver, which sends flattened buckets (the product's default is SGLang's per-tensor
    # receive, which the e2e runs use)
    opts = SyncOptions(bucket_bytes=a.bucket_bytes, timeout_s=a.timeout_s, attempts=a.attempts, flattened=True,
                       receiver="rlslurm")
    broken = {"on": False}

    def export(mc_, model_, dtype):
        from rlslurm.convert import mcore_to_hf

        stream = mcore_to_hf(mc_, model_, dtype=dtype)
        if not (broken["on"] and rank == 0):
            return stream

        def breaking():
            for _ in stream:  # every gather over TP completes: only the sending side breaks
                pass
            raise RuntimeError("the transfer broke (injected by the test)")
            yield  # a generator
        return breaking()

    pub = broadcast_publisher(mc, control, api_key=rd.api_key(), opts=opts, export=export,
                               fallback=DiskPublisher(mc, rd.weights_dir, control, hf_dir=Path(a.hf)),
                               attempt=0, host="127.0.0.1")
    # --colocate's transport: each rank's buffer read in place by the engine it serves (memfd on CPU);
    # the fixture's control publisher names the engines' node "node0"
    ipc = ipc_publisher(mc, control, api_key=rd.api_key(), opts=opts, node="node0", export=export,
                       fallback=DiskPublisher(mc, rd.weights_dir, control, hf_dir=Path(a.hf)), attempt=0)
    v = 0
    while True:
        v += 1
        go = wait_go(out, v, rank)
        broken["on"] = bool(go.get("break_transfer"))
        if go.get("stop"):
            break
        tp_rank = ps.get_tensor_model_parallel_rank()
        with torch.no_grad():  # "training": sharded tensors move differently on each TP rank,
            for i, p in enumerate(model.parameters()):  # replicated ones (norms) identically
                sharded = getattr(p, "tensor_model_parallel", False)
                g = torch.Generator().manual_seed(100_000 * v + 100 * i + (tp_rank if sharded else 0))
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        result: dict = {"version": v}
        t0 = time.monotonic()
        used = ipc if go.get("transport") == "ipc" else pub
        used.leave_paused = bool(go.get("leave_paused"))  # --colocate's turn (trainer/colocate.py)
        try:
            used.publish(model, v)
        except WeightSyncError as e:
            result["error"] = str(e)
        result["seconds"] = time.monotonic() - t0
        result["history"] = [used.deliveries[-1].as_dict()] if used.deliveries else []
        result["greedy"] = greedy(model, mc, prompt, a.new_tokens)
        if rank == 0:
            tmp = out / f".done-{v}.json"
            tmp.write_text(json.dumps(result))
            os.replace(tmp, out / f"done-{v}.json")
    pub.close()
    ipc.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from rlslurm.exit_guard import skip_final_gc_at_exit

    skip_final_gc_at_exit()  # the product roles' exit: seconds of a core saved per torchrun worker
    try:
        main()
    except BaseException:
        traceback.print_exc()
        raise
