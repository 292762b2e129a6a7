"""Rich consoles and tables for the command line.

On a terminal Rich wraps at the terminal's width; into a file or a pipe (a batch log, `rlslurm run >
log`, a test capturing output) it would wrap at 80 columns and leave a trailing space at each break,
so a message with a long run path no longer reads as one line to grep. There it does not wrap at all.

Emoji codes are off: Rich turns `:name:` into an emoji even with markup=False, and a message
naming a file and line ("run.sh:100: ...") has `:100:`, which would print as 💯.

Tables follow the same rule: on a terminal a Rich table whose cells wrap, never cut ("…"); into a
pipe plain tab-separated rows under one header line, whole, so `rlslurm models | grep qwen3-4B` and
`cut -f1` work (Rich cut the name column at 80 columns: "qwen3-…").
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text


def make_console(*, stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    is_tty = hasattr(stream, "isatty") and stream.isatty()
    return Console(stderr=stderr, soft_wrap=not is_tty, emoji=False)


def print_table(console: Console, columns: Sequence[str], rows: Sequence[Sequence[str | Text]], *,
                title: str | None = None, right: Sequence[str] = ()) -> None:
    """`rows` of cells under `columns`: a table on a terminal, TSV otherwise. A str cell is plain text
    (never markup: cells carry user values and "rlslurm[sglang]"); a Text cell may carry a style.

    `right` names the columns right-justified on a terminal (numbers)."""
    if console.is_terminal:
        t = Table(title=title)
        for col in columns:
            t.add_column(col, overflow="fold", justify="right" if col in right else "left")
        for row in rows:
            t.add_row(*(Text(c) if isinstance(c, str) else c for c in row))
        console.print(t)
        return
    out = console.file
    out.write("\t".join(columns) + "\n")
    for row in rows:
        out.write("\t".join(_plain(c) for c in row) + "\n")
    out.flush()


def print_pairs(console: Console, pairs: Sequence[tuple[str, str | Text]]) -> None:
    """Labelled values, one per line: aligned on a terminal, `label<TAB>value` otherwise."""
    if console.is_terminal:
        t = Table(show_header=False, box=None)
        t.add_column(overflow="fold")
        t.add_column(overflow="fold")
        for label, value in pairs:
            t.add_row(label, Text(value) if isinstance(value, str) else value)
        console.print(t)
        return
    for label, value in pairs:
        console.file.write(f"{_plain(label)}\t{_plain(value)}\n")
    console.file.flush()


def _plain(cell: str | Text) -> str:
    """A cell as one TSV field: style dropped, tabs and line breaks made spaces."""
    text = cell.plain if isinstance(cell, Text) else cell
    return text.replace("\t", " ").replace("\n", " ")
