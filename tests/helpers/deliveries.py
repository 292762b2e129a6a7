"""The transport that delivered each weight version, from a run's own record (metrics.jsonl's
`weight_sync/deliveries`, trainer/weights/delivery.py): what a test that claims a transport asserts, since
the disk fallback produces the same outcomes (issue 30: the GPU tier passed on it)."""

from __future__ import annotations

import json
from pathlib import Path


def metrics(run_dir: Path) -> list[dict]:
    p = Path(run_dir) / "metrics.jsonl"
    out = []
    for line in (p.read_text().splitlines() if p.exists() else []):
        try:
            out.append(json.loads(line))
        except ValueError:  # a torn last line
            continue
    return out


def deliveries(run_dir: Path) -> list[dict]:
    """Every publish the trainer recorded, in order, each with the attempt that made it. A fallback that
    reached no engine (the engines went down with the job) delivered nothing and is left out."""
    return [{**d, "attempt": m["attempt"]} for m in metrics(run_dir) for d in m.get("weight_sync/deliveries", [])
            if d.get("engines") != 0]


def final_lineage(run_dir: Path) -> list[int]:
    """The rollout ids trained in the final lineage (a resumed attempt retrains after its checkpoint)."""
    last: dict[int, int] = {}
    for m in metrics(run_dir):
        last[m["rollout_id"]] = m["attempt"]
    return sorted(last)


def assert_delivered_by(run_dir: Path, transport: str, *, versions: set[int] | None = None) -> list[dict]:
    """Every publish went by `transport`, none by the fallback, and each of `versions` (default: the
    version each rollout of the final lineage trained, its id + 1) was delivered. Returns the records."""
    recs = deliveries(run_dir)
    other = [d for d in recs if d["transport"] != transport or d.get("fallback")]
    assert not other, f"not delivered by {transport}: {other[:3]}"
    want = {r + 1 for r in final_lineage(run_dir)} if versions is None else versions
    missing = want - {d["version"] for d in recs}
    # the last version, published after the last rollout's metrics line when the engines came up only then
    final = json.loads((Path(run_dir) / "control" / "weight_version.json").read_text())
    if final.get("transport") == transport and final["version"] == max(want, default=0):
        missing.discard(final["version"])
    assert not missing, f"versions {sorted(missing)} have no delivery record ({len(recs)} records)"
    assert all(m.get("weight_sync/fallbacks", 0) == 0 for m in metrics(run_dir))
    return recs
