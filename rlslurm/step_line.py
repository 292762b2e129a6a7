"""One line per optimizer step, made from that step's metrics record: the line the trainer logs
(trainer-0.log), `rlslurm run` prints and `rlslurm status --follow` shows. One formatter over the
fields of RUN/metrics.jsonl, so the three never disagree and the file is the record behind them:

    rollout 3 step 7 | reward 0.412 | loss 0.0123 | kl 0.0004 | grad 1.23 | tok/s gen 1.2k train 830 |
    step 0.44 s, iteration 2.1 s | weights v4 gloo

(one line; wrapped here): `step` is the optimizer step's time, `iteration` the rollout's whole turn in
the trainer (waiting for it, training, publishing, checkpointing). A field the record lacks is left out (a replay
generates nothing, a version not published yet has no transport), never printed as 0.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

# The metrics.jsonl keys the line is made of (rlslurm/trainer/main.py writes them; generate tokens/s
# is the rollout driver's, carried into the trainer's record from the rollout's metadata).
REWARD, LOSS, KL, PPO_KL, GRAD = "reward_mean", "loss", "kl", "ppo_kl", "grad_norm"
GEN_TOK_S, TRAIN_TOK_S = "rollout/tokens_per_s", "tokens_per_s"
STEP_S, ITERATION_S = ("time/actor_step", "time/critic_step"), "time/iteration"
VERSION, TRANSPORT = "weight_sync/version", "weight_sync/transport"


def _num(v: float) -> str:
    """Three significant digits (metrics.jsonl has them all): the line stays short enough to read."""
    return "0" if v == 0 else f"{v:.3g}"


def _rate(v: float) -> str:
    return f"{v / 1000:.1f}k" if v >= 10_000 else f"{v:.0f}"


def _value(rec: dict[str, Any], key: str) -> float | None:
    v = rec.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _part(rec: dict[str, Any], label: str, key: str, fmt: Callable[[float], str] = _num) -> str | None:
    v = _value(rec, key)
    return None if v is None else f"{label} {fmt(v)}"


def step_line(rec: dict[str, Any]) -> str:
    """The line of one metrics.jsonl record."""
    parts = [f"rollout {rec.get('rollout_id', '?')} step {rec.get('step', '?')}"]
    parts.append(_part(rec, "reward", REWARD, lambda v: f"{v:.3f}"))
    parts.append(_part(rec, "loss", LOSS))
    # `kl`: against the reference model (--use-kl-loss); `ppo_kl`: against the rollout's own policy
    parts.append(_part(rec, "kl", KL) if KL in rec else _part(rec, "ppo_kl", PPO_KL))
    parts.append(_part(rec, "grad", GRAD))
    rates = [p for p in (_part(rec, "gen", GEN_TOK_S, _rate), _part(rec, "train", TRAIN_TOK_S, _rate)) if p]
    parts.append("tok/s " + " ".join(rates) if rates else None)
    step = [v for v in (_value(rec, k) for k in STEP_S) if v is not None]
    times = ([f"step {sum(step):.2f} s"] if step else []) + \
        ([f"iteration {_value(rec, ITERATION_S):.1f} s"] if _value(rec, ITERATION_S) is not None else [])
    parts.append(", ".join(times) or None)
    version = _value(rec, VERSION)
    if version is not None:
        transport = rec.get(TRANSPORT)
        parts.append(f"weights v{version:.0f}" + (f" {transport}" if isinstance(transport, str) else ""))
    return " | ".join(p for p in parts if p)


class MetricsTail:
    """The records appended to a metrics.jsonl since the last `new()`: whole lines only (a line being
    written is read once it ends), from the start of the file or, with `from_end`, from its size now."""

    def __init__(self, path: Path, *, from_end: bool = False):
        self.path = Path(path)
        self.offset = self.path.stat().st_size if from_end and self.path.exists() else 0

    def new(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                rec = json.loads(line)
            except ValueError:  # a line torn by a crash: metrics.jsonl's readers skip it too
                continue
            if isinstance(rec, dict):
                out.append(rec)
        return out
