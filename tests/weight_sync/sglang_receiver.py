"""A weight-update group member the way an SGLang engine joins and receives (run as a script):
SGLang's own `init_custom_process_group`, then per bucket one `broadcast` per tensor, exactly as
`receive_weights_from_distributed` posts them. Prints one JSON line per received bucket.

    python sglang_receiver.py PORT RANK WORLD GROUP SHAPES_JSON [--stall-at N]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
from sglang.srt.utils.common import init_custom_process_group


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("port", type=int)
    ap.add_argument("rank", type=int)
    ap.add_argument("world", type=int)
    ap.add_argument("group")
    ap.add_argument("buckets", help="JSON list of buckets, each a list of shapes")
    ap.add_argument("--stall-at", type=int, default=-1, help="sleep instead of receiving this bucket")
    a = ap.parse_args()
    pg = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{a.port}", world_size=a.world,
                                   rank=a.rank, group_name=a.group)
    print(json.dumps({"joined": True}), flush=True)
    for i, shapes in enumerate(json.loads(a.buckets)):
        if i == a.stall_at:
            print(json.dumps({"stalling": i}), flush=True)
            time.sleep(3600)
        bufs = [torch.empty(s) for s in shapes]
        t0 = time.monotonic()
        try:
            works = [dist.broadcast(b, src=0, group=pg, async_op=True) for b in bufs]
            for w in works:
                w.wait()
        except RuntimeError as e:
            print(json.dumps({"bucket": i, "error": str(e)[:200], "after_s": time.monotonic() - t0}), flush=True)
            raise SystemExit(3)
        print(json.dumps({"bucket": i, "sums": [float(b.double().sum()) for b in bufs]}), flush=True)


if __name__ == "__main__":
    main()
