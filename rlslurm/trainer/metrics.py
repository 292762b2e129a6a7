"""Per-step metrics: one JSON line per optimizer step in RUN/metrics.jsonl and TensorBoard
scalars in RUN/tb/, written by global rank 0 only (single writer: no locks on shared storage).
Lines are appended whole or not at all (buffer/atomic.py `append_line`): a full disk ends the
trainer with a StorageError naming the file, after the checkpoint of that rollout if one was due.

A resumed attempt re-trains the rollouts after its checkpoint, so their steps appear again in
metrics.jsonl; every line carries `attempt` so readers keep the last attempt's line per step.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from rlslurm.buffer.atomic import append_line


class MetricsLogger:
    def __init__(self, metrics_file: Path, tb_dir: Path | None, *, enabled: bool, attempt: int = 0):
        self.enabled = enabled
        self.attempt = attempt
        self.path = Path(metrics_file)
        self._tb = None
        if enabled and tb_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional: metrics.jsonl is the record
                SummaryWriter = None
            if SummaryWriter is not None:
                self._tb = SummaryWriter(log_dir=str(tb_dir))

    def log(self, step: int, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        rec = {"step": step, "attempt": self.attempt, "time": time.time()}
        for k, v in values.items():
            rec[k] = None if isinstance(v, float) and not math.isfinite(v) else v
        append_line(self.path, (json.dumps(rec, sort_keys=False) + "\n").encode(), f"the metrics of step {step}")
        if self._tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl as records, skipping a torn last line."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out
