"""The checkpoints directory: names, the completeness mark, the atomic `latest` pointer, keep-last-K,
and the choice of a checkpoint to resume, falling back past a corrupt or incomplete latest one.

Layout (RUN/checkpoints/):

    iter_0000004/            one checkpoint; 4 = rollouts trained when it was taken
      *.distcp, common.pt, .metadata, metadata.json    written by dist_checkpointing (all ranks)
      rlslurm.json           written LAST by rank 0: sizes (+crc32) of every file, world size
    latest                   {"name": "iter_0000004", "iteration": 4}, replaced by rename

A checkpoint without `rlslurm.json`, or whose files do not match it, is incomplete: it is never
pointed to, and on load it is skipped with a loud warning (the previous complete one is used).
What a checkpoint holds is state.py's; this module only reads and writes the directory.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
import zlib
from pathlib import Path
from typing import Any

from rlslurm.buffer.atomic import (
    StorageError,
    fsync_dir,
    listdir_fresh,
    retry_transient,
    write_json_atomic,
)
from rlslurm.buffer.progress import Retention

log = logging.getLogger(__name__)

PREFIX = "iter_"
META = "rlslurm.json"
LATEST = "latest"
FORMAT = 1
CRC_MAX_BYTES = 256 * 1024**2  # bigger files are checked by size only (a full read costs minutes)


def ckpt_name(iteration: int) -> str:
    return f"{PREFIX}{iteration:07d}"


def iteration_of(name: str) -> int | None:
    """The iteration a checkpoint directory's name stands for; None for any other name."""
    if not name.startswith(PREFIX):
        return None
    try:
        return int(name[len(PREFIX):])
    except ValueError:
        return None


def warn(msg: str) -> None:
    log.warning(msg)
    print(f"rlslurm trainer: WARNING: {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ one checkpoint


def _crc32(path: Path) -> int:
    """The file's crc32; a transient error (EIO, ESTALE, EAGAIN) restarts the read (buffer/atomic.py
    `retry_transient`), one that persists is a TransientStorageError."""
    def once() -> int:
        crc = 0
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                crc = zlib.crc32(chunk, crc)
        return crc

    return retry_transient(once, path, "reading it for its checksum")


def _files(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file() and p.name != META)


def fresh_dir(root: Path, d: Path) -> None:
    """Rank 0, before a save: an empty `d` under `root`. What stands there (a partial save of a crashed
    attempt, or a re-save of the same iteration) loses its completeness mark first."""
    root.mkdir(parents=True, exist_ok=True)
    if d.exists():
        if (d / META).exists():
            (d / META).unlink()
        shutil.rmtree(d)
    d.mkdir()
    fsync_dir(root)


def write_meta(d: Path, iteration: int, world: int, extra: dict[str, Any]) -> None:
    """Fsync every file, record sizes/checksums, then publish META (the completeness mark). Every step
    only reads or rewrites whole, so a transient error repeats it (`retry_transient`)."""
    def once() -> dict[str, Any]:
        files = {}
        for p in _files(d):
            with open(p, "rb") as f:
                os.fsync(f.fileno())
            size = p.stat().st_size
            files[str(p.relative_to(d))] = {"size": size, "crc32": _crc32(p) if size <= CRC_MAX_BYTES else None}
        for sub in {p.parent for p in _files(d)} | {d}:
            fsync_dir(sub)
        return files

    files = retry_transient(once, d, "syncing and summing the checkpoint's files")
    write_json_atomic(d / META,
                      {"format": FORMAT, "iteration": iteration, "world_size": world, "files": files, **extra})


def verify(d: Path) -> str | None:
    """None if checkpoint `d` is complete and intact, else what is wrong with it. Its reads are
    retried on a transient error; one that persists, or any other refusal, makes it unusable (its
    caller falls back to an older checkpoint, or fails the save)."""
    try:
        return retry_transient(lambda: _verify(d), d, "verifying the checkpoint")
    except (OSError, StorageError) as e:
        return f"{d} cannot be read: {e.strerror if isinstance(e, OSError) and e.strerror else e}"


def _verify(d: Path) -> str | None:
    meta_path = d / META
    if not meta_path.exists():
        return f"{meta_path} is missing (checkpoint incomplete)"
    try:
        meta = json.loads(meta_path.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        return f"{meta_path} is unreadable: {e}"
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        return f"{meta_path}: format {meta.get('format') if isinstance(meta, dict) else meta!r} is not {FORMAT}"
    files = meta.get("files", {})
    if not isinstance(files, dict):
        return f"{meta_path}: its file list is damaged"
    for rel, info in files.items():
        p = d / rel
        if not isinstance(info, dict) or not isinstance(info.get("size"), int):
            return f"{meta_path}: the entry of {rel} is damaged"
        if not p.is_file():
            return f"{p} is missing"
        if p.stat().st_size != info["size"]:
            return f"{p} has {p.stat().st_size} bytes, expected {info['size']}"
        if info.get("crc32") is not None and _crc32(p) != info["crc32"]:
            return f"{p}: checksum mismatch"
    return None


def checkpoint_bytes(d: Path) -> int:
    try:
        meta = json.loads((d / META).read_text())
        return sum(int(f["size"]) for f in meta.get("files", {}).values())
    except (OSError, ValueError, KeyError, TypeError):
        return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


# ------------------------------------------------------------------------------ the directory


def point_latest(root: Path, d: Path, iteration: int) -> None:
    """Make the complete, verified checkpoint `d` the one `latest` names (replaced by rename)."""
    write_json_atomic(root / LATEST, {"name": d.name, "iteration": iteration})


def read_latest(root: Path) -> str | None:
    try:
        obj = json.loads((root / LATEST).read_text())
        return str(obj["name"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        warn(f"{root / LATEST} is unreadable ({e}); looking for the newest complete checkpoint instead")
        return None


def candidates(root: Path) -> list[Path]:
    """Checkpoints to try, best first: the one `latest` points to, then the others, newest first."""
    names = listdir_fresh(root)  # a transient error retried; absent: []
    found = sorted((root / n for n in names if iteration_of(n) is not None and (root / n).is_dir()),
                   key=lambda p: iteration_of(p.name), reverse=True)
    latest = read_latest(root)
    if latest is not None and (root / latest) in found:
        found.remove(root / latest)
        found.insert(0, root / latest)
    return found


def find_resume(root: Path, skip: frozenset[Path] = frozenset()) -> Path | None:
    """The newest intact checkpoint, warning loudly about every one passed over (`skip`: ones that
    verified but failed to load)."""
    latest = read_latest(root)
    for i, d in enumerate(candidates(root)):
        if d in skip:
            continue
        problem = verify(d)
        if problem is None:
            if i > 0 or (latest is not None and d.name != latest):
                warn(f"falling back to checkpoint {d} (the latest one is unusable)")
            return d
        warn(f"checkpoint {d} is unusable: {problem}")
    return None


def find_complete(root: Path) -> Path | None:
    """The newest checkpoint with its completeness mark (not re-verified: for sizes and messages)."""
    for d in candidates(root):
        if (d / META).exists():
            return d
    return None


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints (and incomplete older ones). The
    META goes first so that a half-deleted directory can never look complete."""
    latest = read_latest(root)
    dirs = sorted((p for p in root.iterdir() if p.is_dir() and iteration_of(p.name) is not None),
                  key=lambda p: iteration_of(p.name), reverse=True)
    complete = [d for d in dirs if (d / META).exists()]
    keep_set = set(complete[:keep]) | ({root / latest} if latest else set())
    newest_complete = iteration_of(complete[0].name) if complete else -1
    doomed = [d for d in dirs if d not in keep_set and iteration_of(d.name) < newest_complete]
    for d in doomed:
        try:
            (d / META).unlink()
        except FileNotFoundError:
            pass
        fsync_dir(d)
        shutil.rmtree(d, ignore_errors=True)
    if doomed:
        fsync_dir(root)
    return doomed


def retention(root: Path, keep_trained: int, export_dir: Path | None = None) -> Retention:
    """The buffer retention to apply once a checkpoint in `root` is saved and pruned: keep every
    rollout from the first one the OLDEST complete checkpoint on disk trains after a resume. Any
    checkpoint left on disk is one `find_resume` may fall back to (the newer ones corrupt), so the
    number kept follows --keep-checkpoints. Dirs without META are never loaded and do not count.
    A checkpoint is named after `progress.trained_rollouts`, which equals its `next_rollout_id`:
    `TrainerProgress.record_trained` takes rollouts only in order, from 0."""
    dirs = [p for p in root.iterdir() if p.is_dir() and (p / META).exists()] if root.is_dir() else []
    its = [it for it in (iteration_of(p.name) for p in dirs) if it is not None]
    return Retention(keep_trained=keep_trained, keep_from=min(its) if its else None, export_dir=export_dir)


def sweep_incomplete(root: Path, min_age_s: float = 600.0) -> list[Path]:
    """Rank 0 at start-up: remove checkpoint directories a killed save left without their
    completeness mark (never loadable; on a full disk, likely what fills it). Only those whose
    newest file is older than `min_age_s`: a zombie trainer of an earlier attempt may still write."""
    if not root.is_dir():
        return []
    removed = []
    now = time.time()
    for d in root.iterdir():
        if not d.is_dir() or iteration_of(d.name) is None or (d / META).exists():
            continue
        newest = max((p.stat().st_mtime for p in d.rglob("*")), default=d.stat().st_mtime)
        if now - max(newest, d.stat().st_mtime) < min_age_s:
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    if removed:
        fsync_dir(root)
        warn(f"removed {len(removed)} checkpoint(s) a killed save left incomplete: {[d.name for d in removed]}")
    return removed
