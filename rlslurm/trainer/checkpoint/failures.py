"""What a failed save comes from: a full disk or quota, a transient error of the shared filesystem
(docs/checkpoints.md, "When the filesystem fails"), or anything else. megatron wraps the writers'
OSErrors, so each question looks through everything a failure wraps."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

from rlslurm.buffer.atomic import (
    NO_SPACE_ERRNOS,
    TRANSIENT_ERRNOS,
    StorageError,
    StorageFull,
    TransientStorageError,
)


def causes(error: Any) -> Iterator[Any]:
    """`error` and everything it wraps (megatron wraps the writers' OSErrors; a dict maps ranks to
    exceptions; megatron's WRAPPED_EXCEPTION is (exception, traceback)), bounded."""
    seen = 0
    todo: list[Any] = [error]
    while todo and seen < 50:
        e = todo.pop()
        seen += 1
        if isinstance(e, dict):
            todo += list(e.values())
        elif isinstance(e, tuple):
            todo += list(e)
        elif isinstance(e, BaseException):
            todo += [e.__cause__, e.__context__, *getattr(e, "failures", {}).values()]
            yield e
        elif e is not None:
            yield e


def transient_os_error(error: Any) -> OSError | None:
    """The EIO / ESTALE / EAGAIN a failure comes from, if it does (buffer/atomic.py TRANSIENT_ERRNOS)."""
    return next((e for e in causes(error) if isinstance(e, OSError) and e.errno in TRANSIENT_ERRNOS), None)


def is_storage_failure(error: Any) -> bool:
    return any(isinstance(e, (StorageError, TransientStorageError)) or
               (isinstance(e, OSError) and e.errno in TRANSIENT_ERRNOS) for e in causes(error))


def is_no_space(error: BaseException | str | None) -> bool:
    """Does a failure (megatron wraps the writers' OSErrors) come from a full disk or quota?"""
    for e in causes(error):
        if isinstance(e, StorageFull) or (isinstance(e, OSError) and e.errno in NO_SPACE_ERRNOS):
            return True
        text = str(e).lower()
        if "no space left on device" in text or "disk quota exceeded" in text:
            return True
    return False


def nearly_full(path: Path) -> bool:
    """Is the filesystem holding `path` out of space (under 64 MiB or 1 % free, whichever is less)?"""
    try:
        st = os.statvfs(path if path.exists() else path.parent)
    except OSError:
        return False
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    return free < min(64 * 2**20, total / 100)
