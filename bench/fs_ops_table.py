"""The markdown tables of docs/shared-fs-load.md from bench_fs_ops.py's result files.

    python3 bench/fs_ops_table.py bench/results/fs-ops-2nodes-before.json bench/results/fs-ops-4nodes-before.json ...

One row per (process class, run-dir source): in each file, the ops/s measured (all instances of the
class together; a per-rollout source at the run's own rollout rate) and extrapolated to the file's
scale (bench_fs_ops.py `summarize`). Rows under 0.5 ops/s everywhere are summed per class."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

MIN = 0.5


def load(p: Path) -> dict:
    d = json.loads(p.read_text())
    rows = {}
    for r in d["rows"]:
        measured = r["measured_ops"] / d["window_s"]
        rows[(r["class"], r["source"])] = (measured, r["ops_s_at_scale"], r["scales_with"])
    return {"name": f"{d['nodes']} nodes {d['label'].split('-')[0]}", "rows": rows, "total": d["figure"],
            "measured": d["measured_total_ops_s"], "rollouts": d["rollouts_in_window"], "window": d["window_s"]}


def table(files: list[Path]) -> str:
    runs = [load(p) for p in files]
    keys = sorted({k for r in runs for k in r["rows"]})
    big, other = [], defaultdict(lambda: [[0.0, 0.0] for _ in runs])
    for k in keys:
        vals = [r["rows"].get(k, (0.0, 0.0, "")) for r in runs]
        if max(max(v[0], v[1]) for v in vals) >= MIN:
            big.append((k, vals))
        else:
            for i, v in enumerate(vals):
                other[k[0]][i][0] += v[0]
                other[k[0]][i][1] += v[1]
    head = ("| process | source (under the run dir) | "
            + " | ".join(f"{r['name']}: measured / at 128x8" for r in runs) + " |")
    out = [head, "|" + "---|" * (2 + len(runs))]
    big.sort(key=lambda kv: -max(v[1] for v in kv[1]))
    for (cls, src), vals in big:
        out.append(f"| {cls} | `{src}` | " + " | ".join(f"{m:.2f} / {s:.1f}" for m, s, _ in vals) + " |")
    for cls, vals in sorted(other.items()):
        out.append(f"| {cls} | (the rest) | " + " | ".join(f"{m:.2f} / {s:.1f}" for m, s in vals) + " |")
    out.append("| **all** | | " + " | ".join(f"**{r['measured']:.1f} / {r['total']:.1f}**" for r in runs) + " |")
    out.append("| rollouts trained in the window | | "
               + " | ".join(f"{r['rollouts']} in {r['window']:.0f} s" for r in runs) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    print(table([Path(a) for a in sys.argv[1:]]))
