"""Prompt files for tests that resolve a run with the default --num-rollout and --rollout-batch-size:
submit refuses a file whose prompts would run out first (rlslurm/resolve.py `_check_prompt_supply`)."""

from __future__ import annotations

import json

ENOUGH = 100 * 128  # --num-rollout 100 (the default) x the largest --rollout-batch-size of a shipped model config


def prompt_lines(*records: dict, n: int = ENOUGH) -> str:
    """`n` JSON lines cycling through `records` (default: one "say a" prompt)."""
    recs = records or ({"prompt": "say a", "label": "a"},)
    return "".join(json.dumps(recs[i % len(recs)]) + "\n" for i in range(n))


def numbered_prompts(path, n: int):
    """`path` with `n` prompts "say 0" .. "say n-1", each labelled with its number; returns `path`."""
    path.write_text("".join(json.dumps({"prompt": f"say {i}", "label": str(i)}) + "\n" for i in range(n)))
    return path
