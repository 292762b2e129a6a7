"""An SGLang engine spanning two "nodes" on GPUs (engines/span.py; issue 17 item 1): node rank 0 under
rlslurm's EngineSupervisor behind the real router, node rank 1 on the next GPU under a SpanFollower, two
processes meeting at the dist-init address rank 0's SpanLeader picked, NCCL between them, as on two
nodes of a cluster (one host here). The trainer's own publisher (broadcast_publisher) sends
qwen3-1.7B-shaped weights from GPU 0 into the engine over a group of world 1 + TP: with a GPU more than
the engine has, over NCCL (the engine on GPUs 1..TP), else over gloo (the engine from GPU 0; NCCL
refuses two ranks of a group on one GPU).

Variants, by environment (tools/gpu/steps.sh runs them as separate steps):
  RLSLURM_GPU_SPAN_TP=4          the engine's TP size, half of it per node rank (default 2)
  RLSLURM_GPU_SPAN_RECEIVER=rlslurm   rlslurm's receiver in the engine (--update-weight-receiver rlslurm)
  RLSLURM_GPU_SPAN_FLAGS="--enable-dp-attention --dp-size 2"   SGLang flags for the engine

Checked: weights A, then B, then A again: A and A again give the same greedy answers and B others
(a rank that missed a sync would keep the previous weights' shards). Then kill -9 of node rank 1:
the supervisor restarts the engine as one (a new generation, both ranks started again), and after
one publish of A its answers equal A's again. The CPU stack runs the same protocol in a SLURM job
(tests/e2e/test_engine_span_slurm.py); this is the GPU proof of it."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import tempfile
import time
from pathlib import Path

import pytest
import torch


def test_engine_over_two_nodes_follows_every_sync_and_restarts_as_one() -> None:
    tp = int(os.environ.get("RLSLURM_GPU_SPAN_TP", "2"))
    receiver = os.environ.get("RLSLURM_GPU_SPAN_RECEIVER", "sglang")
    flags = tuple(os.environ.get("RLSLURM_GPU_SPAN_FLAGS", "").split())
    per_node = tp // 2
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs: {per_node} per node rank of the engine")
    first_gpu, backend = (1, "nccl") if torch.cuda.device_count() > tp else (0, "gloo")
    from bench.bench_engine_sync import GPU_ENGINE_FLAGS, fill, greedy, hf_tensors, max_logprob_diff, write_model_dir
    from rlslurm.buffer.control import Control
    from rlslurm.buffer.rundir import RunDir
    from rlslurm.engines.engine import EngineSpec
    from rlslurm.engines.receiver import LOADER as RECEIVER_LOADER
    from rlslurm.engines.router import RouterProcess
    from rlslurm.engines.span import SpanFollower, SpanLeader
    from rlslurm.engines.supervisor import EngineSupervisor, control_publisher
    from rlslurm.net import engine_port_block, free_port
    from rlslurm.trainer.weights.base import Roles, SyncOptions
    from rlslurm.trainer.weights.broadcast import broadcast_publisher

    os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")  # as the trainer sets it (docs/gpu.md)
    torch.cuda.set_device(0)
    work = Path(tempfile.mkdtemp(prefix="rlslurm-span-"))
    model = write_model_dir("1.7B", work / "model", "bfloat16")
    control = Control(RunDir.create(work / "run"))
    host, key = "127.0.0.1", secrets.token_urlsafe(24)
    extra = ("--load-format", "dummy", "--skip-tokenizer-init", *GPU_ENGINE_FLAGS, *flags)
    if receiver == "rlslurm":  # what rollout/node.py adds for --update-weight-receiver rlslurm
        extra += ("--custom-weight-loader", RECEIVER_LOADER)

    def spec(rank: int) -> EngineSpec:
        p = engine_port_block(host, 1)[0]
        return EngineSpec(name="engine-0-0", model_path=str(model), host=host, port=p.port, nccl_port=p.nccl_port,
                          log_path=work / f"rank{rank}.log", api_key=key, dtype="bfloat16", device="cuda",
                          base_gpu_id=first_gpu + rank * per_node, tp_size=tp, nnodes=2, node_rank=rank,
                          extra_args=extra)

    router = RouterProcess(host=host, port=free_port(host), log_path=work / "router.log", api_key=key)
    router.start()
    follower = SpanFollower(spec(1), control, attempt=0, node_name="node1", poll_s=0.5).start()
    sup = EngineSupervisor([spec(0)], router, health_interval_s=2.0, on_change=control_publisher(control, "node0"),
                           span=SpanLeader(control, attempt=0))
    named = hf_tensors("1.7B", torch.device("cuda:0"), torch.bfloat16)
    pub = None
    try:
        t0 = time.monotonic()
        sup.start()
        print(f"span engine TP={tp} {' '.join(flags)} on GPUs {first_gpu}-{first_gpu + tp - 1} healthy in "
              f"{time.monotonic() - t0:.1f} s; weights over {backend}, {receiver}'s receiver", flush=True)
        assert [e.ranks for e in control.engines()] == [tp]
        opts = SyncOptions(bucket_bytes=512 * 1024**2, backend=backend, timeout_s=300.0, group_prefix="span",
                           receiver=receiver)
        roles = Roles(exporter=True, leader=True, coordinator=True, stage=0, stages=1, device=torch.device("cuda:0"))
        pub = broadcast_publisher(None, control, api_key=key, opts=opts, host=host, roles=lambda: roles, attempt=0,
                                   export=lambda mc, model_, dt: iter(named))
        version = 0

        def publish(seed: int):
            nonlocal version
            version += 1
            fill(named, seed)
            pub.publish(None, version)
            h = pub.deliveries[-1]
            assert h.transport == backend and not h.fallback and h.tries == 1, h
            print(f"v{version}: {h}", flush=True)
            return asyncio.run(greedy(sup.urls[0], key))

        a, b, a_again = publish(1), publish(2), publish(1)
        same, differ = max_logprob_diff(a, a_again), max_logprob_diff(a, b)
        print(f"A vs A again {same:g}, A vs B {differ:g}", flush=True)
        assert same <= 1e-3 < differ

        old = follower.proc.pid
        os.kill(old, signal.SIGKILL)
        t0 = time.monotonic()
        while not (sup.restarts_total == 1 and all(e.healthy for e in control.engines())):
            assert time.monotonic() - t0 < 400, "the engine did not come back as one"
            time.sleep(0.5)
        print(f"restarted as one in {time.monotonic() - t0:.1f} s: generation {control.span('engine-0-0').generation}, "
              f"rank 1 pid {old} -> {follower.proc.pid}", flush=True)
        assert control.span("engine-0-0").generation >= 2 and follower.proc.pid != old and follower.proc.is_alive()
        a_restarted = publish(1)
        back = max_logprob_diff(a, a_restarted)
        print(f"A vs A after the restart {back:g}", flush=True)
        assert back <= 1e-3
    except BaseException:
        for log in sorted(work.glob("*.log")):  # each rank's and the router's last lines, cut (server_args is huge)
            print(f"--- {log.name}", *(line[:300] for line in log.read_text(errors="replace").splitlines()[-25:]),
                  sep="\n", flush=True)
        raise
    finally:
        if pub is not None:
            pub.close()
        sup.close()
        follower.close()
        router.close()
