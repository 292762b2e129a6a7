"""The reward-curve picture at the end of `rlslurm run` is a convenience: failing to draw it is one
warning line and no picture, never an error for a run that trained (a GPU run once ended rc=1 there)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from rlslurm.curve import plot_png

pytest.importorskip("matplotlib")


def test_a_curve_that_cannot_be_drawn_is_a_warning(tmp_path: Path, caplog) -> None:
    points = [(0, 0.2), (1, 0.5)]
    assert plot_png(points, tmp_path / "curve.png", "t") == tmp_path / "curve.png"
    assert (tmp_path / "curve.png").stat().st_size > 0
    with caplog.at_level(logging.WARNING, logger="rlslurm.curve"):
        assert plot_png(points, tmp_path / "no-such-dir" / "curve.png", "t") is None
    assert "reward curve not drawn (FileNotFoundError" in caplog.text


@pytest.mark.parametrize("ys,ylim", [([0.27, 0.5, 0.99], (-0.05, 1.05)), ([-0.8, 0.2, 0.6], (-1.1, 1.1)),
                                     ([0.5, 3.0, 7.5], None)])
def test_the_picture_has_whole_rollout_ticks_and_a_fixed_range_for_bounded_rewards(ys, ylim) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rlslurm.curve import draw

    fig, ax = plt.subplots()
    try:
        draw(ax, list(enumerate(ys)), "t")
        fig.canvas.draw()
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks  # 3 points: 0, 1, 2, no 0.25 steps
        if ylim is None:
            assert ax.get_ylim()[1] < 8.5 and ax.get_ylim()[0] > 0.0  # auto-scaled to the values
        else:
            assert ax.get_ylim() == pytest.approx(ylim)
    finally:
        plt.close(fig)
