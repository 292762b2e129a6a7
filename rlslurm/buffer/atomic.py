"""Shared-filesystem primitives: the only way this package puts bytes on disk.

NFS, Lustre and GPFS are not local disks. The rules (docs/shared-filesystem.md) are enforced
here so that no other module has to remember them:

- a file becomes visible only complete: temp name in the same directory, write,
  fsync, `os.replace` onto the final name, fsync the directory;
- where two writers could race for one name, the final name is claimed with a hard
  link (`publish_exclusive`), which fails with EEXIST like O_EXCL but, unlike O_EXCL,
  never exposes a half-written file;
- no flock/fcntl locks anywhere;
- a reader re-lists the parent directory before trusting that a name exists or not,
  because NFS caches lookups and listings (acdirmax, often 60 s).
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import stat
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable

from rlslurm.errors import DataError, UserError

# Files are private by default: the run directory itself is 0700 (or 0750 for a group),
# so 0640 only matters when the user asked for group sharing.
DEFAULT_FILE_MODE = 0o640

Cancel = threading.Event | Callable[[], bool] | None


class StorageError(UserError):
    """Writing to the run directory failed (disk full, quota, permissions); names the path."""


class Cancelled(Exception):
    """A wait was cancelled by its `cancel` event or callable."""


def tmp_name(path: Path) -> Path:
    """A temp name beside `path` (same directory, so the rename stays atomic) that no
    other process or thread can pick."""
    return path.with_name(f".tmp.{path.name}.{os.getpid()}.{secrets.token_hex(4)}")


def is_tmp_name(name: str) -> bool:
    return name.startswith(".tmp.")


def fsync_dir(path: str | Path) -> None:
    """Persist a directory's entries (a rename is durable only after this)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as e:  # some network filesystems refuse fsync on directories
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _storage_error(path: Path, e: OSError) -> StorageError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        what = "no space left on device" if e.errno == errno.ENOSPC else "disk quota exceeded"
        return StorageError(
            f"{path}: {what} while writing; the previously committed state is unchanged "
            f"(free space on {path.parent} or move the run directory)"
        )
    return StorageError(f"{path}: cannot write: {e.strerror or e}")


_NO_SPACE = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}


def append_line(path: Path, line: bytes, what: str) -> None:
    """Append + fsync one line of a JSON Lines log with one writer (metrics.jsonl: trainer rank 0;
    rollout_metrics.jsonl: the driver). The line is whole or absent: a write the disk refuses
    (ENOSPC, quota) is cut back off and raised as a StorageError naming the file, and a torn last
    line a crash left behind is ended first, so that it never swallows this one."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)  # RDWR: pread of the last byte
    except OSError as e:
        raise StorageError(f"{path}: cannot open it to append {what}: {e.strerror or e}") from None
    try:
        start = os.fstat(fd).st_size
        try:
            if start and os.pread(fd, 1, start - 1) != b"\n":
                line = b"\n" + line
            view = memoryview(line)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except OSError as e:
            try:
                os.ftruncate(fd, start)  # no part of this line stays behind
            except OSError:
                pass
            reason = _NO_SPACE.get(e.errno, e.strerror or str(e))
            raise StorageError(f"{path}: {reason} while appending {what}; the lines before it are intact "
                               f"(free space on {path.parent}, then `rlslurm resubmit`)") from None
    finally:
        os.close(fd)


_IOV_MAX = 1024  # Linux UIO_MAXIOV; writev refuses more buffers per call


def write_chunks_to(fd: int, chunks: Iterable[bytes | memoryview]) -> int:
    """Write every chunk fully with gathered writes (writev may write less than asked)."""
    pending = [v for v in (memoryview(c).cast("B") for c in chunks) if v.nbytes]
    total, i = 0, 0
    while i < len(pending):
        n = os.writev(fd, pending[i : i + _IOV_MAX])
        total += n
        # skip what was written; a partially written buffer is resumed from its tail
        while n:
            if n >= pending[i].nbytes:
                n -= pending[i].nbytes
                i += 1
            else:
                pending[i] = pending[i][n:]
                n = 0
    return total


def write_tmp(path: Path, chunks: Iterable[bytes | memoryview], mode: int = DEFAULT_FILE_MODE) -> Path:
    """Write chunks to a fresh temp file beside `path`, fsync it, return its name.

    On any error the temp file is removed, so a failed write leaves nothing behind.
    """
    tmp = tmp_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except OSError as e:
        raise _storage_error(path, e) from e
    try:
        try:
            os.fchmod(fd, mode)  # umask-proof
            write_chunks_to(fd, chunks)
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException as e:
        _unlink_quiet(tmp)
        if isinstance(e, OSError):
            raise _storage_error(path, e) from e
        raise
    return tmp


def write_bytes_atomic(path: str | Path, data: bytes | memoryview, *, mode: int = DEFAULT_FILE_MODE) -> None:
    """Replace `path` with `data` atomically and durably (temp + fsync + rename + fsync dir)."""
    path = Path(path)
    tmp = write_tmp(path, [data], mode)
    try:
        os.replace(tmp, path)
    except OSError as e:
        _unlink_quiet(tmp)
        raise _storage_error(path, e) from e
    fsync_dir(path.parent)


def dumps_json(obj: Any) -> bytes:
    return (json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False) + "\n").encode()


def write_json_atomic(path: str | Path, obj: Any, *, mode: int = DEFAULT_FILE_MODE) -> None:
    write_bytes_atomic(path, dumps_json(obj), mode=mode)


def publish_exclusive(path: str | Path, data: bytes, *, mode: int = DEFAULT_FILE_MODE) -> bool:
    """Create `path` with `data` only if no file of that name exists.

    Returns False (and writes nothing) when another writer got there first. The file
    is complete the moment it is visible: it is written under a temp name and then
    hard-linked onto the final name, which is atomic and exclusive on POSIX
    filesystems, NFS included.
    """
    path = Path(path)
    tmp = write_tmp(path, [data], mode)
    try:
        try:
            os.link(tmp, path)
            won = True
        except FileExistsError:
            # NFSv3 may retransmit a LINK that already succeeded and report EEXIST;
            # the link count of our own temp file tells the truth.
            won = os.stat(tmp).st_nlink == 2
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                raise _storage_error(path, e) from e
            won = _publish_exclusive_no_links(path, data, mode)
    finally:
        _unlink_quiet(tmp)
    if won:
        fsync_dir(path.parent)
    return won


def _publish_exclusive_no_links(path: Path, data: bytes, mode: int) -> bool:
    # Filesystems without hard links: O_EXCL on the final name. A reader may briefly
    # see a short file; readers of exclusive files validate content and retry.
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        return False
    try:
        os.fchmod(fd, mode)
        write_chunks_to(fd, [data])
        os.fsync(fd)
    except OSError as e:
        os.close(fd)
        _unlink_quiet(path)
        raise _storage_error(path, e) from e
    os.close(fd)
    return True


# Process logs hold whatever third-party code prints (SGLang prints its whole config); they are the
# owner's only, in a group-shared run too, as the batch script's `umask 077` makes them under SLURM.
LOG_FILE_MODE = 0o600
LOG_DIR_MODE = 0o700
# The umask of everything `rlslurm run` starts: the batch script's (`umask 077`), so files that
# third-party code creates in the run directory (checkpoints, logs) are private on both paths.
PRIVATE_UMASK = 0o077


def open_log(path: str | Path) -> BinaryIO:
    """Open a process log for appending, 0600 whatever the umask (an older log that was created
    wider is narrowed). Its directory is created 0700 if missing."""
    path = Path(path)
    if not path.parent.is_dir():
        path.parent.mkdir(mode=LOG_DIR_MODE, parents=True, exist_ok=True)
        os.chmod(path.parent, LOG_DIR_MODE)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, LOG_FILE_MODE)
    try:
        os.fchmod(fd, LOG_FILE_MODE)
    except OSError:
        os.close(fd)
        raise
    return os.fdopen(fd, "ab")


def ensure_dir(path: str | Path) -> Path:
    """mkdir -p where every created directory gets its parent's mode (0700, or 2750 in a
    group-shared run directory), set with chmod so the umask cannot widen or narrow it."""
    path = Path(path)
    if path.is_dir():
        return path
    ensure_dir(path.parent)
    mode = stat.S_IMODE(os.stat(path.parent).st_mode)
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        return path  # another process made it; it set the same mode
    os.chmod(path, mode)
    return path


def listdir_fresh(path: str | Path) -> list[str]:
    """List a directory, bypassing cached negative lookups (NFS re-validates a
    directory when it is read). Missing directory -> []."""
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []


def exists_fresh(path: str | Path) -> bool:
    path = Path(path)
    return path.name in listdir_fresh(path.parent)


def read_bytes(path: str | Path) -> bytes | None:
    """Read a whole file; None if it is absent after re-listing its parent."""
    path = Path(path)
    listdir_fresh(path.parent)
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def read_json(path: str | Path) -> dict | None:
    """Read a JSON object written by `write_json_atomic`; None if absent.

    A file that is present but not a JSON object is a DataError naming it: atomic
    writers never produce one, so it is corruption or a foreign file.
    """
    path = Path(path)
    data = read_bytes(path)
    if data is None:
        return None
    try:
        obj = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(str(path), f"not valid JSON ({e}); the file is corrupt or was written non-atomically") from e
    if not isinstance(obj, dict):
        raise DataError(str(path), f"expected a JSON object, found {type(obj).__name__}")
    return obj


def unlink_durable(path: str | Path, *, missing_ok: bool = True) -> bool:
    """Remove a file and persist the removal; True if this call removed it."""
    path = Path(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        if not missing_ok:
            raise
        return False
    fsync_dir(path.parent)
    return True


def _unlink_quiet(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def is_cancelled(cancel: Cancel) -> bool:
    if cancel is None:
        return False
    if isinstance(cancel, threading.Event):
        return cancel.is_set()
    return bool(cancel())


def sleep_or_cancel(seconds: float, cancel: Cancel) -> None:
    """Sleep, waking early (and raising Cancelled) if `cancel` fires."""
    if isinstance(cancel, threading.Event):
        if cancel.wait(seconds):
            raise Cancelled()
        return
    time.sleep(seconds)
    if is_cancelled(cancel):
        raise Cancelled()
