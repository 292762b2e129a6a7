"""The reward curve of a run: from RUN/metrics.jsonl (the trainer's record), one point per rollout
(the last attempt's line wins when a resumed attempt re-trained a rollout)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger("rlslurm.curve")
_BLOCKS = "▁▂▃▄▅▆▇█"


def reward_curve(run_dir: Path) -> list[tuple[int, float]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    by_rollout: dict[int, float] = {}
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:  # torn last line after a crash
            continue
        if "rollout_id" in rec and rec.get("reward_mean") is not None:
            by_rollout[int(rec["rollout_id"])] = float(rec["reward_mean"])
    return sorted(by_rollout.items())


def sparkline(values: list[float], lo: float | None = None, hi: float | None = None) -> str:
    if not values:
        return ""
    lo = min(values) if lo is None else lo
    hi = max(values) if hi is None else hi
    span = (hi - lo) or 1.0
    return "".join(_BLOCKS[min(len(_BLOCKS) - 1, int((v - lo) / span * len(_BLOCKS)))] for v in values)


# Rewards inside one of these ranges are drawn on all of it, so two runs' pictures compare at a
# glance and a flat curve at 0.95 does not look like a cliff; others are scaled to their values.
BOUNDED_RANGES = ((0.0, 1.0), (-1.0, 1.0))


def reward_range(values: list[float]) -> tuple[float, float] | None:
    """The smallest of BOUNDED_RANGES holding every value, or None (auto-scaled)."""
    for lo, hi in BOUNDED_RANGES:
        if values and min(values) >= lo and max(values) <= hi:
            return lo, hi
    return None


def draw(ax, points: list[tuple[int, float]], title: str) -> None:
    """The curve on a matplotlib axis: rollouts are whole numbers (no 2.5 tick), and a bounded reward
    gets its whole range with a margin."""
    from matplotlib.ticker import MaxNLocator

    xs, ys = [p[0] for p in points], [p[1] for p in points]
    ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.5)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    bounds = reward_range(ys)
    if bounds:
        margin = 0.05 * (bounds[1] - bounds[0])
        ax.set_ylim(bounds[0] - margin, bounds[1] + margin)
    ax.set_xlabel("rollout")
    ax.set_ylabel("mean reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)


def plot_png(points: list[tuple[int, float]], out: Path, title: str) -> Path | None:
    """Write the reward curve as a PNG; None when matplotlib is not installed or drawing fails. The
    picture is a convenience: a run that trained must not end in error because of it (on the GPU
    machines matplotlib's backend set-up once raised on a stand-in IPython module, docs/gpu.md)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    try:
        fig, ax = plt.subplots(figsize=(6, 3.2), dpi=120)
        try:
            draw(ax, points, title)
            fig.tight_layout()
            fig.savefig(out)
        finally:
            plt.close(fig)
    except Exception as e:  # noqa: BLE001 -- any failure to draw, reported in one line
        log.warning("reward curve not drawn (%s: %s)", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None
    return out
