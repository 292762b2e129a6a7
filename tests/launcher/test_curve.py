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
