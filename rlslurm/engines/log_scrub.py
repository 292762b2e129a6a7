"""Keep the job's api key out of the SGLang server's and the router's logs.

SGLang (0.5.23, engine.py `_server_args_for_logging`) logs its whole config at start:
`server_args={..., 'api_key': '<KEY>', ...}` -- it redacts only watermark secrets. The key cannot
be kept from SGLang (it needs it to check requests), so what the server prints is filtered: the
launcher (`python -m rlslurm.engines.engine`, which knows the key) forks a filter process before
handing over to SGLang and points its own stdout and stderr (fds 1, 2) at a pipe into that
filter, which copies everything to the real log with every occurrence of the key replaced by
`***`. SGLang's scheduler and detokenizer processes inherit fds 1 and 2, so their output passes
the same filter, whatever prints it (Python logging, print, C++ code, a crash).

The filter is in the server's process group, so the supervisor's killpg ends it with the server;
otherwise it ends when every writer has closed the pipe (end of file).

Being the log's only writer, the filter also bounds it: past MAX_LOG_BYTES it renames the log to
`<log>.1` (replacing an older one) at a line end and starts a new one, so one server keeps at most
twice that. The launcher passes the log's path (and the size) in ENV_LOG_ROTATE. Why the engine and
router logs need it, and the other logs of an attempt do not: docs/logs.md.
"""

from __future__ import annotations

import os
import signal
import sys

MASK = b"***"
_CHUNK = 65536
MAX_LOG_BYTES = 256 << 20
ENV_LOG_ROTATE = "RLSLURM_LOG_ROTATE"  # "<max bytes>:<log path>", set by the launcher


def rotate_env(log_path: str | os.PathLike[str], max_bytes: int = MAX_LOG_BYTES) -> dict[str, str]:
    return {ENV_LOG_ROTATE: f"{max_bytes}:{os.fspath(log_path)}"}


def parse_rotate_env(value: str | None) -> tuple[str, int] | None:
    size, sep, path = (value or "").partition(":")
    return (path, int(size)) if sep and path and size.isdigit() and int(size) > 0 else None


class Scrubber:
    """Streaming replace of `secret` by MASK, correct when the secret is split across chunks: what
    could still be the start of the secret is held back until the next chunk (or the end)."""

    def __init__(self, secret: bytes, mask: bytes = MASK):
        if not secret:
            raise ValueError("empty secret")
        self.secret, self.mask = secret, mask
        self._held = b""

    def feed(self, chunk: bytes) -> bytes:
        buf = (self._held + chunk).replace(self.secret, self.mask)
        keep = self._partial_tail(buf)
        self._held = buf[len(buf) - keep:] if keep else b""
        return buf[: len(buf) - keep]

    def flush(self) -> bytes:
        out, self._held = self._held, b""
        return out

    def _partial_tail(self, buf: bytes) -> int:
        """Length of the longest tail of `buf` that is a proper prefix of the secret."""
        for n in range(min(len(self.secret) - 1, len(buf)), 0, -1):
            if buf.endswith(self.secret[:n]):
                return n
        return 0


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class _RotatingLog:
    """Writes to `fd` (the log at `path`); once it holds `max_bytes`, the next line end closes it:
    it becomes `path`.1 and a new file (0600) takes its place on the same descriptor number."""

    def __init__(self, fd: int, path: str, max_bytes: int):
        self.fd, self.path, self.max_bytes = fd, path, max_bytes
        self.size = os.fstat(fd).st_size

    def write(self, data: bytes) -> None:
        # rotate at the first line end at or past max_bytes; a line without one yet goes on as is
        while self.size + len(data) >= self.max_bytes:
            nl = data.find(b"\n", max(0, self.max_bytes - self.size - 1))
            if nl < 0:
                break
            _write_all(self.fd, data[:nl + 1])
            data = data[nl + 1:]
            self._rotate()
        _write_all(self.fd, data)
        self.size += len(data)

    def _rotate(self) -> None:
        try:
            os.replace(self.path, self.path + ".1")
            new = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        except OSError:  # keep writing where we are; tried again after another max_bytes
            self.size = 0
            return
        os.fchmod(new, 0o600)
        os.dup2(new, self.fd)
        os.close(new)
        self.size = 0


def copy_scrubbed(src: int, dst: int, secret: bytes, rotate: tuple[str, int] | None = None) -> None:
    """Copy `src` to `dst` until end of file, the secret masked; with `rotate` = (path of dst, max
    bytes), dst is rotated to path.1 whenever it reaches that size."""
    s = Scrubber(secret)
    out = _RotatingLog(dst, *rotate) if rotate else None
    write = out.write if out else (lambda data: _write_all(dst, data))
    while True:
        try:
            chunk = os.read(src, _CHUNK)
        except InterruptedError:
            continue
        if not chunk:
            break
        write(s.feed(chunk))
    write(s.flush())


def redirect_through_scrubber(secret: str, rotate: tuple[str, int] | None = None) -> int:
    """Fork the filter and point this process's fds 1 and 2 at it; returns the filter's pid.
    `rotate`: (path of the log on fd 1, max bytes), see copy_scrubbed. Call before any thread is
    started (fork)."""
    sys.stdout.flush()
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the filter
        try:
            os.close(write_end)
            # A TERM/INT/HUP to the whole group must not cut the last lines of a dying server off:
            # the filter ends at end of file (or by the supervisor's SIGKILL to the group).
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)
            copy_scrubbed(read_end, 1, secret.encode(), rotate)
        finally:
            os._exit(0)
    os.close(read_end)
    os.dup2(write_end, 1)
    os.dup2(write_end, 2)
    os.close(write_end)
    return pid


def finish(pid: int, timeout_s: float = 10.0) -> None:
    """At the server's normal end: close our ends of the pipe and give the filter a bounded time to
    write the rest (a child that outlives the server keeps the pipe open: then we stop waiting)."""
    import time

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.close(devnull)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            return
        time.sleep(0.05)
