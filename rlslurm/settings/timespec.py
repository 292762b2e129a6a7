"""SLURM's `--time` formats, parsed to seconds (sbatch(1), "-t, --time")."""

from __future__ import annotations

import re

# SLURM takes both words; a limit of 0 also means "no limit".
_UNLIMITED = ("UNLIMITED", "INFINITE")
_FORMS = (
    (re.compile(r"(\d+)"), ("m",)),
    (re.compile(r"(\d+):(\d+)"), ("m", "s")),
    (re.compile(r"(\d+):(\d+):(\d+)"), ("h", "m", "s")),
    (re.compile(r"(\d+)-(\d+)"), ("d", "h")),
    (re.compile(r"(\d+)-(\d+):(\d+)"), ("d", "h", "m")),
    (re.compile(r"(\d+)-(\d+):(\d+):(\d+)"), ("d", "h", "m", "s")),
)
_UNIT_S = {"d": 86400, "h": 3600, "m": 60, "s": 1}
FORMS_HELP = "MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or UNLIMITED"


def time_limit_s(value: str) -> int | None:
    """Seconds of a SLURM time limit; None for no limit. ValueError names the accepted forms."""
    if value.upper() in _UNLIMITED:
        return None
    for pattern, units in _FORMS:
        # fullmatch: `$` would also accept a trailing newline, which then reaches the #SBATCH line
        m = pattern.fullmatch(value)
        if m:
            seconds = sum(int(g) * _UNIT_S[u] for g, u in zip(m.groups(), units))
            return seconds or None
    raise ValueError(f"{value!r} is not a SLURM time ({FORMS_HELP})")
