"""Two processes, one GPU each, one NCCL broadcast between them, built the way rlslurm's weight sync
builds its group (a TCPStore-backed ProcessGroupNCCL outside torchrun's default group), under several
device-visibility and NCCL settings. Run on the GPU machine (no bundle needed):

    python3 tools/gpu/nccl_pair_check.py

It prints one line per variant: ok with the time of a 256 MiB broadcast, or the error. It isolates
whether the weight-sync failure seen with SGLang ("unhandled cuda error ... invalid argument") comes from
NCCL between two processes in this environment or from the engine (docs/gpu.md)."""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import time

# (name, trainer's CUDA_VISIBLE_DEVICES, engine's, trainer's extra env, engine's extra env). SGLang sets
# NCCL_CUMEM_ENABLE=0 in its engine when the variable is unset; a trainer left at NCCL's default (1)
# then disagrees with it about how peer buffers are shared.
VARIANTS = [
    ("each sees its own GPU only", "0", "1", {}, {}),
    ("each sees both, own first", "0,1", "1,0", {}, {}),
    ("CUMEM: trainer default, engine 0 (as SGLang sets it)", "0", "1", {}, {"NCCL_CUMEM_ENABLE": "0"}),
    ("CUMEM: both 0", "0", "1", {"NCCL_CUMEM_ENABLE": "0"}, {"NCCL_CUMEM_ENABLE": "0"}),
]


def peer(rank: int, port: int, device: int) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout)
    store = dist.PrefixStore("g/", dist.PrefixStore("g", store))
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    pg = dist.ProcessGroupNCCL(store, rank, 2, opts)
    t = torch.full((64 * 2**20,), 7.0 if rank == 0 else 0.0, device="cuda", dtype=torch.float32)
    for _ in range(2):  # the first includes connection set-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        o = dist.BroadcastOptions()
        o.rootRank, o.rootTensor = 0, 0
        pg.broadcast([t], o).wait()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    assert bool((t == 7.0).all()), "wrong data received"
    print(f"rank {rank}: {dt * 1e3:.2f} ms for 256 MiB", flush=True)


def main() -> int:
    if len(sys.argv) > 1:
        peer(int(sys.argv[1]), int(sys.argv[2]), 0)
        return 0
    bad = 0
    for name, vis0, vis1, extra0, extra1 in VARIANTS:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = []
        for rank, vis, extra in ((0, vis0, extra0), (1, vis1, extra1)):
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": vis, "NCCL_DEBUG": "WARN", **extra}
            if "NCCL_CUMEM_ENABLE" not in extra:
                env.pop("NCCL_CUMEM_ENABLE", None)  # NCCL's own default
            procs.append(subprocess.Popen([sys.executable, __file__, str(rank), str(port)], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=90)[0])
            except subprocess.TimeoutExpired:
                p.kill()
                outs.append("TIMEOUT\n" + (p.communicate()[0] or ""))
        ok = all(p.returncode == 0 for p in procs)
        bad += not ok
        detail = outs[0].strip().splitlines()[-1] if ok else " | ".join(
            l for o in outs for l in o.splitlines() if "rror" in l or "TIMEOUT" in l or "NCCL WARN" in l)[:600]
        print(f"{'ok  ' if ok else 'FAIL'} {name} (trainer {vis0}, engine {vis1}): {detail}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
