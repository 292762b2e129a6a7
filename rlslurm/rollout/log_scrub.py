"""Keep the job's api key out of the SGLang server's and the router's logs.

SGLang (0.5.23, engine.py `_server_args_for_logging`) logs its whole config at start:
`server_args={..., 'api_key': '<KEY>', ...}` -- it redacts only watermark secrets. The key cannot
be kept from SGLang (it needs it to check requests), so what the server prints is filtered: the
launcher (`python -m rlslurm.rollout.engine`, which knows the key) forks a filter process before
handing over to SGLang and points its own stdout and stderr (fds 1, 2) at a pipe into that
filter, which copies everything to the real log with every occurrence of the key replaced by
`***`. SGLang's scheduler and detokenizer processes inherit fds 1 and 2, so their output passes
the same filter, whatever prints it (Python logging, print, C++ code, a crash).

The filter is in the server's process group, so the supervisor's killpg ends it with the server;
otherwise it ends when every writer has closed the pipe (end of file).
"""

from __future__ import annotations

import os
import signal
import sys

MASK = b"***"
_CHUNK = 65536


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


def copy_scrubbed(src: int, dst: int, secret: bytes) -> None:
    """Copy `src` to `dst` until end of file, the secret masked."""
    s = Scrubber(secret)
    while True:
        try:
            chunk = os.read(src, _CHUNK)
        except InterruptedError:
            continue
        if not chunk:
            break
        _write_all(dst, s.feed(chunk))
    _write_all(dst, s.flush())


def redirect_through_scrubber(secret: str) -> int:
    """Fork the filter and point this process's fds 1 and 2 at it; returns the filter's pid.
    Call before any thread is started (fork)."""
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
            copy_scrubbed(read_end, 1, secret.encode())
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
