"""Compare the field check's runs (tools/gpu/field-check.sh) and print one JSON record.

For each interrupted run: how often each step was trained (a step logged twice was re-trained after a
resume: the signal's checkpoint did not hold it), whether it finished, its ledger reasons and
checkpoints, and the largest difference of its final per-step metrics from the straight run's.
Uses only the standard library: it reads the runs' files, not rlslurm.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

COMPARED = ("loss", "pg_loss", "grad_norm", "entropy", "ppo_kl", "kl_loss")


def records(run: Path) -> list[dict]:
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a torn last line
    return out


def last_per_step(recs: list[dict]) -> dict[int, dict]:
    final: dict[int, dict] = {}
    for r in recs:  # file order: a later attempt's line replaces an earlier one's
        final[r["step"]] = r
    return final


def summary(run: Path, straight: dict[int, dict] | None) -> dict:
    recs = records(run)
    counts = Counter(r["step"] for r in recs)
    final = last_per_step(recs)
    out: dict = {
        "finished": (run / "FINISHED").exists(),
        "steps": len(final),
        "rollouts": len({r["rollout_id"] for r in final.values()}),
        "steps_trained_twice": sorted(s for s, n in counts.items() if n > 1),
        "attempts": sorted({r["attempt"] for r in recs}),
        "ledger": [json.loads(line).get("reason") for line in (run / "ledger.jsonl").read_text().splitlines()
                   if line.strip()] if (run / "ledger.jsonl").exists() else [],
        "checkpoints": sorted(p.name for p in (run / "checkpoints").glob("iter_*")),
    }
    if straight is not None:
        diffs = {}
        for key in COMPARED:
            d = [abs(final[s][key] - straight[s][key]) for s in final.keys() & straight.keys()
                 if isinstance(final[s].get(key), (int, float)) and isinstance(straight[s].get(key), (int, float))]
            if d:
                diffs[key] = max(d)
        out["max_abs_diff_vs_straight"] = diffs
        out["same_steps_as_straight"] = sorted(final) == sorted(straight)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("straight", type=Path)
    ap.add_argument("runs", type=Path, nargs="+")
    ap.add_argument("--rc", nargs="*", default=[], help="name=exit code of each rlslurm run")
    a = ap.parse_args()
    ref = summary(a.straight, None)
    straight = last_per_step(records(a.straight))
    res = {"straight": ref, **{r.name: summary(r, straight) for r in a.runs},
           "exit_codes": dict(kv.split("=", 1) for kv in a.rc)}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
