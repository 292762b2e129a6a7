"""Shared by the settings tests (and others): resolve must refuse with one line that names every given flag."""

from __future__ import annotations

import pytest

from rlslurm.errors import ConfigError
from rlslurm.resolve import resolve


def one_line_naming(argv: list[str], *names: str) -> str:
    with pytest.raises(ConfigError) as e:
        resolve(argv)
    msg = str(e.value)
    assert "\n" not in msg, msg
    for n in names:
        assert n in msg, (n, msg)
    return msg
