"""What a run's own records say ran: one JSON line per run directory, for claims in bench/results and
docs that must name the mechanism (issue 30), re-checkable with one command:

    python3 tools/run_record.py RUN_DIR [RUN_DIR ...]
    tar -xzf bench/results/X-runs.tgz -C /tmp/x && python3 tools/run_record.py /tmp/x/*/run

Per run: the attempts and how each ended (ledger), the rollouts each attempt trained, every publish's
transport (metrics.jsonl `weight_sync/deliveries`: versions per transport, fallbacks, tries > 1), the
probes, and per attempt the GPUs each role used: SLURM's or rlslurm's CUDA_VISIBLE_DEVICES and the
GPU UUIDs (env-trainer-*.json from torch, env-rollout-*.json and control/engines.json through nvidia-smi).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _jsonl(p: Path) -> list[dict]:
    out = []
    for line in (p.read_text().splitlines() if p.exists() else []):
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def record(run: Path) -> dict:
    metrics = _jsonl(run / "metrics.jsonl")
    trained: dict[int, list[int]] = {}
    for m in metrics:
        ids = trained.setdefault(m["attempt"], [])
        if not ids or ids[-1] != m["rollout_id"]:
            ids.append(m["rollout_id"])
    deliveries = [d for m in metrics for d in m.get("weight_sync/deliveries", [])]
    delivered = [d for d in deliveries if d.get("engines") != 0]
    by_transport: dict[str, list[int]] = {}
    for d in delivered:
        by_transport.setdefault(d["transport"] + (" (fallback)" if d.get("fallback") else ""), []).append(d["version"])
    probes = _jsonl(run / "control" / "weight_probe.jsonl")
    gpus = {}
    for a in sorted(run.glob("logs/attempt-*"), key=lambda p: int(p.name.split("-")[1])):
        reps = {p.stem.removeprefix("env-"): json.loads(p.read_text()) for p in a.glob("env-*.json")}
        gpus[a.name] = {
            "trainer": sorted({(r.get("cuda_visible_devices"), r.get("gpu_uuid")) for k, r in reps.items()
                               if k.startswith("trainer")}, key=str),
            "rollout": sorted({(r.get("cuda_visible_devices"), tuple(r.get("gpu_uuids") or ())) for k, r in reps.items()
                               if k.startswith("rollout")}, key=str)}
    engines = run / "control" / "engines.json"
    eng = json.loads(engines.read_text())["engines"] if engines.exists() else []
    wv = run / "control" / "weight_version.json"
    return {
        "run": str(run),
        "ledger": [(l.get("attempt"), l.get("reason")) for l in _jsonl(run / "ledger.jsonl") if "attempt" in l],
        "trained": trained,
        "publishes": len(deliveries),
        "versions_by_transport": {k: sorted(set(v)) for k, v in by_transport.items()},
        "not_delivered": sorted({d["version"] for d in deliveries if d.get("engines") == 0}),
        "retried": sorted({d["version"] for d in delivered if d.get("tries", 1) > 1}),
        "fallbacks": max((m.get("weight_sync/fallbacks", 0) for m in metrics), default=0),
        "weight_version": json.loads(wv.read_text()) if wv.exists() else None,
        "probes": {"count": len(probes), "at_version": sum(all(str(e.get("weight_version")) == str(p["version"])
                                                              for e in p["engines"].values()) for p in probes),
                   "greedy_equal": sum(bool(p.get("match")) for p in probes)},
        "gpus": gpus,
        "engines": [{"url": e["url"], "gpu_uuids": e.get("gpu_uuids"), "restarts": e.get("restarts")} for e in eng],
    }


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    for a in argv:
        print(json.dumps(record(Path(a)), default=list))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
