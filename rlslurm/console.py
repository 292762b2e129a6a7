"""Rich consoles for the command line.

On a terminal Rich wraps at the terminal's width; into a file or a pipe (a batch log, `rlslurm run >
log`, a test capturing output) it would wrap at 80 columns and leave a trailing space at each break,
so a message with a long run path no longer reads as one line to grep. There it does not wrap at all.
"""

from __future__ import annotations

import sys

from rich.console import Console


def make_console(*, stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    is_tty = hasattr(stream, "isatty") and stream.isatty()
    return Console(stderr=stderr, soft_wrap=not is_tty)
