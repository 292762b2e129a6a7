"""`rlslurm logs`: an attempt's logs without the lines that say nothing about the run.

The logs on disk stay whole (`rlslurm logs --raw` shows them as they are); the view leaves out, and
counts, lines of the known kinds in NOISE, each matched whole: nanobind's leak report at interpreter
exit (triton's bindings, from every trainer and rollout process), HTTP access lines of requests that
succeeded (the SGLang servers' uvicorn lines, httpx's in older logs); a failed request's line is kept.
What they are and how much of a log's end they filled: docs/logs.md, "Reading them: `rlslurm logs`".
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

_NANOBIND_SEE = "See https://nanobind.readthedocs.io/en/latest/refleaks.html"
NOISE: dict[str, re.Pattern[str]] = {
    # the report's last line has no line break of its own where two processes end at once
    "nanobind leak report lines": re.compile(
        rf"({re.escape(_NANOBIND_SEE)})*(nanobind: .*| - leaked (instance|type|function|keep_alive record)s? .*"
        r"| - \.\.\. skipped remainder)?"),
    "HTTP access lines (2xx/3xx)": re.compile(
        r"(\[[^\]]*\] )?INFO:\s+\S+ - \"[A-Z]+ \S+ HTTP/[\d.]+\" [23]\d\d( .*)?"),
    "HTTP client lines (2xx/3xx)": re.compile(
        r".*\bHTTP Request: [A-Z]+ \S+ \"HTTP/[\d.]+ [23]\d\d [^\"]*\""),
}

_CHUNK = 1 << 16
_SCAN_LIMIT = 64 << 20  # bytes read back from a log's end to find its useful tail


def noise_kind(line: str) -> str | None:
    """The NOISE kind `line` is, or None: a line worth showing."""
    text = line.rstrip("\r\n")
    if not text:
        return None
    for kind, pattern in NOISE.items():
        if pattern.fullmatch(text):
            return kind
    return None


@dataclass
class Tail:
    lines: list[str]
    hidden: Counter[str] = field(default_factory=Counter)


def useful_tail(path: Path, n: int) -> Tail:
    """The last `n` lines of `path` that are not noise, and the noise lines among those read to find them
    (read back from the end: an engine log can be hundreds of MiB)."""
    out: list[str] = []
    hidden: Counter[str] = Counter()
    with open(path, "rb") as f:
        pos = f.seek(0, os.SEEK_END)
        start, carry = pos, b""
        while len(out) < n and pos > 0 and start - pos < _SCAN_LIMIT:
            step = min(_CHUNK, pos)
            pos -= step
            f.seek(pos)
            block = f.read(step) + carry
            parts = block.split(b"\n")
            carry = parts[0] if pos > 0 else b""
            for raw in reversed(parts[1:] if pos > 0 else parts):
                if len(out) >= n:
                    break
                if not raw and not out and not hidden:  # the file's final line break
                    continue
                line = raw.decode(errors="replace")
                kind = noise_kind(line)
                if kind is None:
                    out.append(line)
                else:
                    hidden[kind] += 1
    return Tail(out[::-1], hidden)


def hidden_note(hidden: Counter[str]) -> str | None:
    if not hidden:
        return None
    kinds = ", ".join(f"{c} {k}" for k, c in hidden.most_common())
    return f"(hid {sum(hidden.values())} lines: {kinds}; --raw shows them)"


def show(files: Iterable[Path], n: int, out: TextIO = sys.stdout) -> None:
    """Each file's useful tail under a `==> file <==` header, as `tail` prints several."""
    for i, p in enumerate(files):
        t = useful_tail(p, n)
        out.write(("\n" if i else "") + f"==> {p} <==\n")
        out.writelines(l + "\n" for l in t.lines)
        if (note := hidden_note(t.hidden)) is not None:
            out.write(note + "\n")
    out.flush()


class _Followed:
    """A file read from an offset on; started again from 0 when it was replaced (the engine logs'
    rotation, docs/logs.md) or cut."""

    def __init__(self, path: Path, *, from_end: bool):
        self.path, self.ino, self.offset, self.partial = path, None, 0, b""
        try:
            st = path.stat()
            self.ino, self.offset = st.st_ino, st.st_size if from_end else 0
        except FileNotFoundError:
            pass

    def new_lines(self) -> list[str]:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return []
        if st.st_ino != self.ino or st.st_size < self.offset:
            self.ino, self.offset, self.partial = st.st_ino, 0, b""
        if st.st_size == self.offset:
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = self.partial + f.read(st.st_size - self.offset)
        self.offset = st.st_size
        *lines, self.partial = data.split(b"\n")
        return [l.decode(errors="replace") for l in lines]


def follow(files: Callable[[], list[Path]], out: TextIO = sys.stdout, *, poll_s: float = 0.5,
           until: Callable[[], bool] = lambda: False) -> Counter[str]:
    """Print the lines appended to the logs `files()` lists (listed again at every poll: an engine's log
    appears once it starts) from now on, noise left out, under a header whenever the file changes; until
    `until()` or Ctrl-C. A log that appears later is printed from its start. Returns what it hid."""
    followed = {p: _Followed(p, from_end=True) for p in files()}
    hidden: Counter[str] = Counter()
    current: Path | None = None
    try:
        while True:
            for p in files():
                if p not in followed:
                    followed[p] = _Followed(p, from_end=False)
            for fl in followed.values():
                lines = fl.new_lines()
                kinds = [noise_kind(l) for l in lines]
                keep = [l for l, k in zip(lines, kinds) if k is None]
                hidden.update(k for k in kinds if k is not None)
                if keep:
                    if fl.path != current:
                        out.write(f"\n==> {fl.path} <==\n")
                        current = fl.path
                    out.writelines(l + "\n" for l in keep)
                    out.flush()
            if until():
                return hidden
            time.sleep(poll_s)
    except KeyboardInterrupt:
        return hidden
