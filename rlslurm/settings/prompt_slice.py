"""slime's `PATH@[START:END]` prompt-file syntax: train (or evaluate) on a slice of a file's records.

slime (`slime/utils/data.py::_parse_generalized_path`) accepts a Python slice without a step after
the path: either bound may be empty or negative (`data.jsonl@[-100:]` is the last 100 records). A
record is a non-empty line of a JSON Lines file or a row of a parquet file; the slice is taken
before shuffling, so every epoch serves the same records (docs/slime-flags.md).

Kept as part of the path value (`--prompt-data`, the paths of `--eval-prompt-data`) so a slime
command line works unchanged and run.yaml records the slice with the file it belongs to.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from rlslurm.errors import ConfigError

_SLICE = re.compile(r"^(?P<path>.*)@\[(?P<start>-?\d*):(?P<end>-?\d*)\]$")
# anything that looks like slice syntax but is not slime's form: refused instead of read as a file name
_LOOKS_LIKE_SLICE = re.compile(r"@\[[^\]]*\]$")


@dataclass(frozen=True)
class PromptSpec:
    path: Path
    start: int | None = None
    end: int | None = None

    @property
    def sliced(self) -> bool:
        return self.start is not None or self.end is not None

    def bounds(self, n_records: int) -> tuple[int, int]:
        """[lo, hi) of the records the slice keeps out of a file of `n_records` (Python's rules)."""
        lo, hi, _ = slice(self.start, self.end).indices(n_records)
        return lo, max(lo, hi)

    def __str__(self) -> str:
        if not self.sliced:
            return str(self.path)
        return f"{self.path}@[{'' if self.start is None else self.start}:{'' if self.end is None else self.end}]"


def parse_prompt_spec(value: str | os.PathLike[str], flag: str = "--prompt-data") -> PromptSpec:
    """Split `PATH@[START:END]` (either bound optional); ConfigError naming `flag` for a malformed slice."""
    s = os.fspath(value)
    m = _SLICE.match(s)
    if m is None:
        if _LOOKS_LIKE_SLICE.search(s):
            raise ConfigError(f"{flag} {s}: a slice is PATH@[START:END] with integer (or empty) bounds and "
                              f"no step, e.g. data.jsonl@[0:1000] or data.jsonl@[-100:]")
        return PromptSpec(Path(s))
    if not m.group("path"):
        raise ConfigError(f"{flag} {s}: no file before the @[START:END] slice")
    if "-" in (m.group("start"), m.group("end")):
        raise ConfigError(f"{flag} {s}: a slice bound is an integer, got '-'")
    start = int(m.group("start")) if m.group("start") else None
    end = int(m.group("end")) if m.group("end") else None
    if start is None and end is None:
        return PromptSpec(Path(m.group("path")))
    return PromptSpec(Path(m.group("path")), start, end)
