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
  because NFS caches lookups and listings (acdirmax, often 60 s);
- a transient error (EIO, ESTALE, EAGAIN: a routine NFS/Lustre hiccup) is retried with backoff
  (`retry_transient`); one that persists, a full disk and any other refusal are `StorageError`s,
  which fail the attempt (requeued within --max-failures), never a user error
  (docs/shared-filesystem.md, "When the filesystem fails").
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import stat
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, TypeVar

from rlslurm.errors import DataError

log = logging.getLogger(__name__)

# Files are private by default: the run directory itself is 0700 (or 0750 for a group),
# so 0640 only matters when the user asked for group sharing.
DEFAULT_FILE_MODE = 0o640

Cancel = threading.Event | Callable[[], bool] | None


class StorageError(Exception):
    """Writing to the run directory failed; names the path. Not a UserError: nothing the user
    typed is wrong, and the filesystem may be fine again after a requeue, so the role exits as a
    failure (one line, rlslurm/user_error.py `run_role`) and the attempt is requeued within
    --max-failures."""


class StorageFull(StorageError):
    """ENOSPC / EDQUOT: names the filesystem, how full it is and what the write needed."""


class TransientStorageError(StorageError):
    """EIO / ESTALE / EAGAIN that persisted through every retry of `retry_transient`."""


# NFS/Lustre/GPFS report a server or network hiccup as EIO, a file handle invalidated by another
# node's rename as ESTALE, a busy lock manager or server as EAGAIN: worth retrying.
TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.ESTALE, errno.EAGAIN})
NO_SPACE_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}
# Backoff between tries (16 s in all): long enough for an NFS server failover's retransmits, short
# against a heartbeat's hang bound (rlslurm/watchdog.py). Tests shorten it.
RETRY_DELAYS_S: tuple[float, ...] = (0.1, 0.2, 0.5, 1.0, 2.0, 4.0, 8.0)
# Test hook (tests and bench/bench_chaos.py only): while the file this names exists, every try of
# `retry_transient` fails with EIO before it touches the run directory, as an NFS/Lustre server
# hiccup would; the window is the file's lifetime. The file's text narrows it: `PART` only the
# operations on paths containing PART, `first:PART` only the first try of each (every operation then
# meets one EIO and goes on: bench_chaos.py's eio_ckpt, over one whole checkpoint save). Unset in every
# real run.
TEST_EIO_ENV = "RLSLURM_TEST_EIO_FILE"
_TEST_EIO_FILE = os.environ.get(TEST_EIO_ENV) or None


def _injected_eio(path: str | Path, first_try: bool) -> bool:
    try:
        with open(_TEST_EIO_FILE, "rb") as f:  # type: ignore[arg-type]
            spec = f.read().decode(errors="replace").strip()
    except FileNotFoundError:
        return False
    first = spec.startswith("first:")
    return (first_try or not first) and spec.removeprefix("first:") in str(path)

T = TypeVar("T")


def retry_transient(fn: Callable[[], T], path: str | Path, what: str) -> T:
    """`fn()`, again after each backoff delay while it raises a transient OSError; a transient error
    that outlasts them is a TransientStorageError naming `path`. `fn` must be safe to repeat (each
    try writes a fresh temp file, or only reads)."""
    for i, delay in enumerate((*RETRY_DELAYS_S, None)):
        try:
            if _TEST_EIO_FILE is not None and _injected_eio(path, i == 0):
                raise OSError(errno.EIO, f"Input/output error (injected: {TEST_EIO_ENV})")
            return fn()
        except OSError as e:
            if e.errno not in TRANSIENT_ERRNOS:
                raise
            if delay is None:
                raise TransientStorageError(
                    f"{path}: {e.strerror or e} while {what}, still after {len(RETRY_DELAYS_S) + 1} tries over "
                    f"{sum(RETRY_DELAYS_S):.0f} s; this attempt fails and is requeued (--max-failures)") from e
            log.warning("%s: %s while %s; retrying in %.1f s", path, e.strerror or e, what, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


def filesystem_of(path: str | Path) -> tuple[str, str]:
    """(mount point, filesystem type) holding `path` (its nearest existing ancestor), from
    /proc/self/mountinfo; ("?", "?") where that cannot be read."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    real = os.path.realpath(p)
    best, fstype = "?", "?"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                mnt = left.split()[4].replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and (best == "?" or len(mnt) > len(best)):
                    best, fstype = mnt, right.split()[0]
    except (OSError, IndexError):
        pass
    return best, fstype


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def storage_full(path: str | Path, errno_: int, what: str, needs: str | None) -> StorageFull:
    """The one line of a full filesystem: which one, how full, what the write needed, and that
    what was committed before is intact."""
    mount, fstype = filesystem_of(path)
    try:
        st = os.statvfs(Path(path).parent if not Path(path).is_dir() else path)
        room = f"{human_size(st.f_bavail * st.f_frsize)} free of {human_size(st.f_blocks * st.f_frsize)}"
    except OSError:
        room = "free space unknown"
    return StorageFull(
        f"{path}: {NO_SPACE_ERRNOS[errno_]} while {what}; filesystem {mount} ({fstype}) has {room}"
        f"{'; ' + needs if needs else ''}; the last checkpoint and everything committed before are intact "
        f"(free space on {mount} or move the run directory, then `rlslurm resubmit`)")


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


def _storage_error(path: Path, e: OSError, needs: int | None = None) -> StorageError:
    if e.errno in NO_SPACE_ERRNOS:
        return storage_full(path, e.errno, f"writing {path.name}",
                            None if needs is None else f"it needs {human_size(needs)}")
    return StorageError(f"{path}: cannot write: {e.strerror or e}")


def storage_errors(path: str | Path, what: str, needs: int | None = None) -> Callable[[Callable[[], T]], T]:
    """Run a write to `path`: transient errors retried (`retry_transient`), then every OSError as the
    StorageError that names it. Used as `storage_errors(path, what)(fn)`."""
    path = Path(path)

    def run(fn: Callable[[], T]) -> T:
        try:
            return retry_transient(fn, path, what)
        except OSError as e:
            raise _storage_error(path, e, needs) from e

    return run


def append_line(path: Path, line: bytes, what: str) -> None:
    """Append + fsync one line of a JSON Lines log with one writer (metrics.jsonl: trainer rank 0;
    rollout_metrics.jsonl: the driver). The line is whole or absent: a write the disk refuses
    (ENOSPC, quota) is cut back off and raised as a StorageError naming the file, and a torn last
    line a crash left behind is ended first, so that it never swallows this one. A transient error
    is retried the same way: the line cut back off, then appended again."""
    path = Path(path)

    def once() -> None:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)  # RDWR: pread of the last byte
        try:
            start = os.fstat(fd).st_size
            try:
                data = line if not start or os.pread(fd, 1, start - 1) == b"\n" else b"\n" + line
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            except OSError:
                try:
                    os.ftruncate(fd, start)  # no part of this line stays behind
                except OSError:
                    pass
                raise
        finally:
            os.close(fd)

    try:
        retry_transient(once, path, f"appending {what}")
    except OSError as e:
        if e.errno in NO_SPACE_ERRNOS:
            raise storage_full(path, e.errno, f"appending {what}", f"it needs {human_size(len(line))}") from None
        raise StorageError(f"{path}: {e.strerror or e} while appending {what}; "
                           "the lines before it are intact") from None


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


def _write_tmp(path: Path, chunks: Iterable[bytes | memoryview], mode: int, *, durable: bool = True) -> Path:
    """`write_tmp` raising the OSError itself (for a caller that retries)."""
    tmp = tmp_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        try:
            # umask-proof; the chmod is a SETATTR round trip to the metadata server per write (a third of
            # a heartbeat's cost, docs/shared-fs-load.md), so only when the umask took bits from `mode`
            # (the fstat is answered from the attributes the open fetched)
            if stat.S_IMODE(os.fstat(fd).st_mode) != mode:
                os.fchmod(fd, mode)
            write_chunks_to(fd, chunks)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        _unlink_quiet(tmp)
        raise
    return tmp


def write_tmp(path: Path, chunks: Iterable[bytes | memoryview], mode: int = DEFAULT_FILE_MODE) -> Path:
    """Write chunks to a fresh temp file beside `path`, fsync it, return its name.

    On any error the temp file is removed, so a failed write leaves nothing behind. A transient
    error is retried when the chunks can be read again (bytes, a list: not a one-shot iterator)."""
    if not isinstance(chunks, (list, tuple)):
        try:
            return _write_tmp(path, chunks, mode)
        except OSError as e:
            raise _storage_error(path, e) from e
    return storage_errors(path, f"writing {path.name}", needs=sum(memoryview(c).nbytes for c in chunks))(
        lambda: _write_tmp(path, chunks, mode))


def write_bytes_atomic(path: str | Path, data: bytes | memoryview, *, mode: int = DEFAULT_FILE_MODE,
                       durable: bool = True) -> None:
    """Replace `path` with `data` atomically and durably (temp + fsync + rename + fsync dir); a
    transient error retries the whole sequence with a fresh temp file. `durable=False`: atomic but
    without the two fsyncs, for a record whose loss in a crash costs nothing and which is rewritten
    often (a heartbeat: after a crash its writer is gone anyway; docs/shared-fs-load.md)."""
    path = Path(path)

    def once() -> None:
        tmp = _write_tmp(path, [data], mode, durable=durable)
        try:
            os.replace(tmp, path)
        except OSError:
            _unlink_quiet(tmp)
            raise
        if durable:
            fsync_dir(path.parent)

    storage_errors(path, f"writing {path.name}", needs=memoryview(data).nbytes)(once)


def dumps_json(obj: Any) -> bytes:
    return (json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False) + "\n").encode()


def write_json_atomic(path: str | Path, obj: Any, *, mode: int = DEFAULT_FILE_MODE, durable: bool = True) -> None:
    write_bytes_atomic(path, dumps_json(obj), mode=mode, durable=durable)


def publish_exclusive(path: str | Path, data: bytes, *, mode: int = DEFAULT_FILE_MODE) -> bool:
    """Create `path` with `data` only if no file of that name exists.

    Returns False (and writes nothing) when another writer got there first. The file
    is complete the moment it is visible: it is written under a temp name and then
    hard-linked onto the final name, which is atomic and exclusive on POSIX
    filesystems, NFS included.
    """
    path = Path(path)
    tries = 0

    def once() -> bool:
        nonlocal tries
        tries += 1
        tmp = _write_tmp(path, [data], mode)
        try:
            try:
                os.link(tmp, path)
                won = True
            except FileExistsError:
                # NFSv3 may retransmit a LINK that already succeeded and report EEXIST;
                # the link count of our own temp file tells the truth. After a transient error
                # an earlier try of ours may have linked it: then the name holds exactly our data.
                won = os.stat(tmp).st_nlink == 2 or (tries > 1 and _holds(path, data))
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                    raise
                won = _publish_exclusive_no_links(path, data, mode)
        finally:
            _unlink_quiet(tmp)
        if won:
            fsync_dir(path.parent)
        return won

    return storage_errors(path, f"publishing {path.name}", needs=len(data))(once)


def _holds(path: Path, data: bytes) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(data) + 1) == data
    except FileNotFoundError:
        return False


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
    except OSError:
        os.close(fd)
        _unlink_quiet(path)
        raise
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
    directory when it is read). Missing directory -> []. Transient errors are retried."""
    def once() -> list[str]:
        try:
            return os.listdir(path)
        except (FileNotFoundError, NotADirectoryError):  # no such directory (a file on its path)
            return []

    try:
        return _read_retrying(once, path, "listing it")
    except OSError as e:  # EACCES, ...: one line naming it, not a traceback
        raise StorageError(f"{path}: cannot list it: {e.strerror or e}") from e


def _read_retrying(fn: Callable[[], T], path: str | Path, what: str) -> T:
    """A read: transient errors retried; one that persists is a TransientStorageError; any other
    OSError propagates as it is."""
    return retry_transient(fn, path, what)


def exists_fresh(path: str | Path) -> bool:
    path = Path(path)
    return path.name in listdir_fresh(path.parent)


def read_bytes(path: str | Path) -> bytes | None:
    """Read a whole file; None if it is absent after re-listing its parent."""
    path = Path(path)
    listdir_fresh(path.parent)

    def once() -> bytes | None:
        got = _read_record_bytes(path)
        return None if got is None else got[0]

    return _read_retrying(once, path, "reading it")


# The most a record of the run directory is read to (a manifest, a control record, the ledger): a name
# that is no such record (a symlink to /dev/zero, a huge foreign file) must not be read without end.
MAX_RECORD_BYTES = 256 << 20


class NotARecord(ValueError):
    """What is under a record's name is no file the run wrote: a FIFO, a device, or too large."""


def read_regular(path: str | Path, limit: int = MAX_RECORD_BYTES) -> tuple[bytes, int] | None:
    """(the bytes of the regular file `path`, its inode); None if absent. Anything else under that name
    is NotARecord naming it: a FIFO (an open would wait on it forever), a device such as /dev/zero (read
    without end), a file over `limit`. Opened without blocking, and checked before any read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotARecord(f"{path}: not a regular file (a {_kind_of(st.st_mode)})")
        chunks, left = [], limit + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:
            raise NotARecord(f"{path}: over {human_size(limit)}, not a record of the run")
        return data, st.st_ino
    finally:
        os.close(fd)


def _kind_of(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISDIR, "directory")):
        if test(mode):
            return name
    return "special file"


def _read_record_bytes(path: Path) -> tuple[bytes, int] | None:
    """`read_regular`, where what is no record reads as b"" with a warning: every record's parser then
    refuses it as damaged, and its caller sets it aside."""
    try:
        return read_regular(path)
    except NotARecord as e:
        log.warning("%s; read as damaged", e)
        try:
            return b"", os.stat(path).st_ino
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


class CorruptRecord(StorageError):
    """A record the run wrote itself (atomically) reads as damaged twice: the filesystem damaged it.
    It was set aside (kept for a post-mortem), so the next attempt's writer rebuilds it; this
    attempt fails and is requeued within --max-failures."""


CORRUPT_PREFIX = ".corrupt."


def read_bytes_ino(path: str | Path, *, relist: bool = True) -> tuple[bytes, int] | None:
    """`read_bytes`, with the inode the bytes came from (for `set_aside`). `relist=False`: the caller
    has just listed the parent (and found the name), so it is not listed again."""
    path = Path(path)
    if relist:
        listdir_fresh(path.parent)

    return _read_retrying(lambda: _read_record_bytes(path), path, "reading it")


def set_aside(path: str | Path, ino: int) -> Path | None:
    """Move a damaged file (inode `ino`, as read) out of its name, to `.corrupt.<name>.<time>`,
    without ever taking a newer version its writer put there meanwhile: if the name holds another
    inode by the time it is moved, that one goes back (unless a still newer one took the name).
    Returns where the damaged file went, or None if it was no longer there."""
    path = Path(path)
    aside = path.with_name(f"{CORRUPT_PREFIX}{path.name}.{int(time.time())}.{secrets.token_hex(2)}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return None
    if os.stat(aside).st_ino != ino:  # the writer replaced it after our read: that version is good
        try:
            os.link(aside, path)
        except FileExistsError:
            pass  # a newer one still
        _unlink_quiet(aside)
        return None
    fsync_dir(path.parent)
    return aside


# A record that reads as damaged is read once more after this long (a filesystem that briefly served a
# torn block) before it is set aside (`read_hint`, buffer/control.py `read_record`).
REREAD_S = 0.2


def read_hint(path: str | Path, *, set_aside_damaged: bool = True) -> dict | None:
    """A JSON object the run wrote itself (atomically) and can do without or rebuild (buffer/trained.json,
    a hand-back, a quarantine's reason.json): None if absent. One that reads as damaged twice, 0.2 s
    apart, was damaged on disk: it is set aside as `.corrupt.<name>.<time>` (`set_aside_damaged=False`: a
    reader that must not change the run leaves it) with one warning naming it, and reads as None; its
    caller says what it uses instead (docs/shared-filesystem.md, "When the filesystem fails")."""
    path = Path(path)
    for last in (False, True):
        got = read_bytes_ino(path)
        if got is None:
            return None
        data, ino = got
        try:
            obj = json.loads(data)
            if isinstance(obj, dict):
                return obj
            problem = f"a JSON {type(obj).__name__}, not an object"
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            problem = f"not valid JSON ({e})"
        if not last:
            time.sleep(REREAD_S)
    if not set_aside_damaged:
        log.warning("%s: damaged on disk (%s); read as absent", path, problem)
        return None
    aside = set_aside(path, ino)
    if aside is None:  # replaced by its writer meanwhile: read that one
        return read_hint(path)
    log.warning("%s: damaged on disk (%s); set aside as %s and read as absent", path, problem, aside.name)
    return None


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
