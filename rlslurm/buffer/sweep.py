"""What killed writers leave in the run directory, swept at each attempt's start.

Every write is temp + rename (buffer/atomic.py), so a writer killed mid-write (SIGKILL past
KillWait, a node failure, a full disk) never leaves a torn file under a real name, only debris
that nothing reads: `.tmp.*` files, in the buffer a data file whose commit never published its
manifest (buffer/writer.py), and in weights/ a whole model copy a disk publish was building
(`.tmp-v<N>-<pid>/`, trainer/weights/disk.py `export_hf`). On a full disk that debris may be what fills it. The rollout
driver sweeps at its start (rollout/driver.py); the trainer sweeps the checkpoints it never completed
(trainer/checkpoint/directory.py `sweep_incomplete`).

Only files older than `min_age_s` go: a writer of another attempt that still runs (a zombie the
next attempt supersedes, buffer/attempts.py) has its files seconds old.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

from rlslurm.buffer.atomic import fsync_dir, is_tmp_name, listdir_fresh
from rlslurm.buffer.manifest import KINDS, kind_dir
from rlslurm.buffer.rundir import RunDir

log = logging.getLogger(__name__)

MIN_AGE_S = 600.0  # the same bound as RolloutWriter.cleanup
# The directory an HF export is built in beside its target: `.tmp-<target name>-<pid>`
EXPORT_TMP_PREFIX = ".tmp-"


def _tmp_debris(d: Path, now: float, min_age_s: float) -> list[Path]:
    removed = []
    for name in listdir_fresh(d):
        if not is_tmp_name(name):
            continue
        p = d / name
        try:
            if now - p.lstat().st_mtime < min_age_s or not p.is_file():
                continue
            os.unlink(p)
            removed.append(p)
        except FileNotFoundError:
            continue
    if removed:
        fsync_dir(d)
    return removed


def _tmp_trees(d: Path, now: float, min_age_s: float) -> list[Path]:
    """Directories an export killed mid-way left (`.tmp-v<N>-<pid>/`), none of whose files was written
    within `min_age_s` (a live export writes a file every shard)."""
    removed = []
    for name in listdir_fresh(d):
        p = d / name
        if not name.startswith(EXPORT_TMP_PREFIX) or not p.is_dir() or p.is_symlink():
            continue
        try:
            newest = max([p.lstat().st_mtime, *(f.lstat().st_mtime for f in p.rglob("*"))])
        except FileNotFoundError:
            continue  # being renamed into place, or removed, meanwhile
        if now - newest < min_age_s:
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    if removed:
        fsync_dir(d)
    return removed


def sweep(rd: RunDir, min_age_s: float = MIN_AGE_S) -> list[Path]:
    """Remove the debris of killed writers (see the module docstring); returns what was removed."""
    from rlslurm.buffer.writer import RolloutWriter

    now = time.time()
    removed: list[Path] = []
    for kind in KINDS:
        if kind_dir(rd.buffer_dir, kind).is_dir():
            removed += RolloutWriter(rd, kind=kind).cleanup(min_age_s=min_age_s)
    for d in (rd.path, rd.control_dir, rd.control_dir / "heartbeats", rd.buffer_dir, rd.checkpoints_dir,
              rd.weights_dir):
        removed += _tmp_debris(d, now, min_age_s)
    removed += _tmp_trees(rd.weights_dir, now, min_age_s)
    if removed:
        log.info("swept %d files killed writers left in %s", len(removed), rd.path)
    return removed
