"""Per-step metrics: one JSON line per optimizer step in RUN/metrics.jsonl, TensorBoard scalars in
RUN/tb/ and, with --use-wandb, the trainer's W&B run (rlslurm/metrics_sink.py), written by global
rank 0 only (single writer: no locks on shared storage). Lines are appended whole or not at all
(buffer/atomic.py `append_line`): a full disk ends the trainer with a StorageError naming the
file, after the checkpoint of that rollout if one was due.

A resumed attempt re-trains the rollouts after its checkpoint, so their steps appear again in
metrics.jsonl; every line carries `attempt` so readers keep the last attempt's line per step.

Each record is also logged as one line (rlslurm/step_line.py), after it is written: the trainer's
log shows every step, as slime's and verl's do, and that line never says what the file does not.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlslurm.metrics_sink import JsonlSink, open_sinks
from rlslurm.step_line import step_line

if TYPE_CHECKING:
    from rlslurm.settings.config import RunConfig

log = logging.getLogger("rlslurm.trainer.step")


class MetricsLogger:
    def __init__(self, metrics_file: Path, tb_dir: Path | None, *, enabled: bool, attempt: int = 0,
                 cfg: "RunConfig | None" = None):
        self.enabled = enabled
        self.attempt = attempt
        self.path = Path(metrics_file)
        self.sinks = None
        if enabled:
            jsonl = JsonlSink(self.path, lambda rec: f"the metrics of step {rec['step']}")
            self.sinks = open_sinks("trainer", jsonl, tb_dir=tb_dir, cfg=cfg, attempt=attempt)

    def log(self, step: int, values: dict[str, Any]) -> None:
        if self.sinks is None:
            return
        rec = {"step": step, "attempt": self.attempt, "time": time.time()}
        for k, v in values.items():
            rec[k] = None if isinstance(v, float) and not math.isfinite(v) else v
        self.sinks.log(rec, step=step, rollout_id=int(values.get("rollout_id", step)))
        log.info("%s", step_line(rec))

    def close(self) -> None:
        if self.sinks is not None:
            self.sinks.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl as records, skipping a torn last line."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out
