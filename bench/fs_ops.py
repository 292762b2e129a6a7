"""Counting a run's metadata operations on its run directory from strace logs (bench_fs_ops.py).

One strace per process of the run (`strace -f -qq -y -p PID`), attached in steady state, traces the
syscalls that name a path (`%file`) plus those acting on a directory or file descriptor that a
shared filesystem's metadata server sees (getdents, fsync). A line counts when a path it names is
under the run directory. `-y` prints every descriptor with its path, so `getdents64(3</run/control>)`
and `fsync(5</run/control/.x.tmp>)` are attributed as well.

What counts as a metadata operation (one round trip to an NFS server or a Lustre MDS, cold cache):
open/openat (any flags; O_CREAT ones are also counted apart), stat/lstat/newfstatat/statx/access
on a path, getdents, fsync/fdatasync, rename, unlink, mkdir, rmdir, link, utimensat, chmod/fchmod
(a SETATTR), readlink. An fstat of an open descriptor (`newfstatat(fd, "", AT_EMPTY_PATH)`, Python does one
after every open) is counted apart as `fstat(fd)` and not in the total: it is answered from the
attributes the open just fetched.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

# strace's -e trace= set: every syscall naming a path, plus the descriptor-based ones that reach
# the metadata server. read/write/close/epoll (the rest of `desc`) are data or socket traffic, and
# tracing them on the SGLang engines would cost more CPU than the two cores of the test host have.
TRACE = "%file,getdents,getdents64,fsync,fdatasync,fstat,ftruncate,fchmod"

OPEN = {"open", "openat", "creat", "openat2"}
STAT = {"stat", "lstat", "newfstatat", "statx", "access", "faccessat", "faccessat2", "readlink", "readlinkat"}
DIRLIST = {"getdents", "getdents64"}
SYNC = {"fsync", "fdatasync"}
RENAME = {"rename", "renameat", "renameat2"}
UNLINK = {"unlink", "unlinkat", "rmdir"}
MKDIR = {"mkdir", "mkdirat"}
OTHER_META = {"link", "linkat", "symlink", "symlinkat", "utimensat", "utime", "utimes", "chmod", "fchmodat", "fchmod",
              "truncate", "ftruncate", "chown", "fchownat", "lchown"}


def op_class(name: str, args: str) -> str | None:
    """The metadata class of one syscall, None for one that is not a metadata operation."""
    if name in OPEN:
        return "open+creat" if "O_CREAT" in args else "open"
    if name in ("newfstatat", "statx") and "AT_EMPTY_PATH" in args:
        return "fstat(fd)"
    if name == "fstat":
        return "fstat(fd)"
    if name in STAT:
        return "stat"
    if name in DIRLIST:
        return "readdir"
    if name in SYNC:
        return "fsync"
    if name in RENAME:
        return "rename"
    if name in UNLINK:
        return "unlink"
    if name in MKDIR:
        return "mkdir"
    if name in OTHER_META:
        return "other"
    return None


_LINE = re.compile(r"^(?:\[pid\s+\d+\]\s+|\d+\s+)?(\w+)\((.*)$")
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')
_FD = re.compile(r"\d+<([^>]*)>")


@dataclass
class Counts:
    """Metadata operations on the run directory of one traced process tree."""
    by_class: Counter = field(default_factory=Counter)          # op class -> n
    by_source: Counter = field(default_factory=Counter)         # (source, op class) -> n
    paths: Counter = field(default_factory=Counter)             # relative path -> n (ops in the total)


def _paths(args: str) -> list[str]:
    # the fd annotations first (getdents/fsync), then quoted path arguments; the returned fd's
    # annotation (after " = ") is not an argument
    head = args.rsplit(") = ", 1)[0] if ") = " in args else args
    return [m.group(1) for m in _FD.finditer(head)] + [m.group(1) for m in _QUOTED.finditer(head)]


def source_of(rel: str) -> str:
    """What a run-dir path is for, coarse enough to extrapolate: heartbeats, each control record,
    the buffer, logs, metrics, checkpoints, weights."""
    parts = rel.split("/")
    top = parts[0]
    if top == "control" and len(parts) > 1:
        if parts[1] == "heartbeats":
            return "control/heartbeats/" + (_role_of(parts[2]) if len(parts) > 2 else "")
        name = parts[1]
        if name.startswith("."):  # a temp file: .tmp.<name>.<pid>.<hex>
            name = re.sub(r"^\.(tmp\.)?|\.tmp.*$|\.\d+\.[0-9a-f]+$|\.\d+$", "", name)
        name = re.sub(r"node\d+", "node<k>", name)
        name = re.sub(r"rendezvous-\d+", "rendezvous-<a>", name)
        return "control/" + name
    if top == "buffer":
        return "buffer"
    if top in ("logs", "checkpoints", "weights", "tb"):
        return top
    if top.startswith("metrics"):
        return "metrics"
    return top or "."


def _role_of(hb_name: str) -> str:
    """heartbeats/trainer-3.json -> 'trainer-<r>', its tmp files too."""
    m = re.search(r"(trainer|rollout)-\d+", hb_name)
    return f"{m.group(1)}-<r>" if m else hb_name


def count(log: Path, run_dir: Path, cwd: Path | None = None) -> Counts:
    run = str(run_dir).rstrip("/") + "/"
    out = Counts()
    for line in log.read_text(errors="replace").splitlines():
        if "resumed>" in line or line.startswith(("+++", "---")):
            continue  # the path was on the line of the call's start
        m = _LINE.match(line.strip())
        if not m:
            continue
        name, args = m.group(1), m.group(2)
        cls = op_class(name, args)
        if cls is None:
            continue
        for p in _paths(args):
            if not p.startswith("/") and cwd is not None:
                p = str(cwd / p)
            if p == run.rstrip("/") or p.startswith(run):
                rel = p[len(run):] if p.startswith(run) else "."
                out.by_class[cls] += 1
                out.by_source[(source_of(rel), cls)] += 1
                if cls != "fstat(fd)":
                    out.paths[re.sub(r"\d{3,}|[0-9a-f]{8,}", "N", rel)] += 1
                break
    return out


def total(c: Counts) -> int:
    """Metadata operations, fstat of an open descriptor excluded (see the module's docstring)."""
    return sum(n for k, n in c.by_class.items() if k != "fstat(fd)")
