"""Read-side view of one buffer directory, shared by the writer, the reader and the CLI."""

from __future__ import annotations

import logging
import os
import re
import stat
from pathlib import Path

from rlslurm.buffer import codec, integrity
from rlslurm.buffer.atomic import NotARecord, listdir_fresh, read_hint, read_regular
from rlslurm.buffer.manifest import (
    CorruptRollout,
    Manifest,
    kind_dir,
    manifest_name,
    parse_manifest_name,
)
from rlslurm.buffer.rundir import RunDir
from rlslurm.buffer.sample import Rollout
from rlslurm.errors import ConfigError

log = logging.getLogger(__name__)

TRAINED_FILE = "trained.json"
MAX_MANIFEST_BYTES = 16 << 20  # a manifest is a few KiB per 4 MiB block checksum list
QUARANTINE_DIR = "quarantine"
# A quarantine directory's name: <kind>-<rollout id>-<time>-<random> (reader.py `quarantine`)
_QUARANTINE_RE = re.compile(r"(train|eval)-([0-9]+)-[0-9]+-[0-9a-f]+")


def as_rundir(run: RunDir | str | Path) -> RunDir:
    return run if isinstance(run, RunDir) else RunDir(run)


class BufferStore:
    """Committed rollouts of one kind ('train' or 'eval') in a run directory."""

    def __init__(self, run: RunDir | str | Path, *, kind: str = "train"):
        self.run = as_rundir(run)
        self.kind = kind
        self.dir = kind_dir(self.run.buffer_dir, kind)
        self.quarantine_dir = self.run.buffer_dir / QUARANTINE_DIR
        self.trained_file = self.run.buffer_dir / TRAINED_FILE

    def _require_dir(self) -> None:
        if not self.run.buffer_dir.is_dir():
            raise ConfigError(f"{self.run.path}: not a run directory with a buffer (no {self.run.buffer_dir})")

    def committed_ids(self) -> list[int]:
        """Ids whose manifest exists now (fresh directory listing), ascending."""
        ids = (parse_manifest_name(n) for n in listdir_fresh(self.dir))
        return sorted(i for i in ids if i is not None)

    def is_committed(self, rollout_id: int) -> bool:
        return manifest_name(rollout_id) in listdir_fresh(self.dir)

    def manifest_path(self, rollout_id: int) -> Path:
        return self.dir / manifest_name(rollout_id)

    def manifest(self, rollout_id: int) -> Manifest | None:
        """The verified manifest, None if not committed, CorruptRollout if bad."""
        path = self.manifest_path(rollout_id)
        try:
            got = read_regular(path, MAX_MANIFEST_BYTES)
        except NotARecord as e:  # a FIFO or /dev/zero under its name: never waited on, never read without end
            raise CorruptRollout(rollout_id, str(path), str(e).removeprefix(f"{path}: ")) from None
        if got is None:
            return None
        m = Manifest.from_bytes(got[0], path, rollout_id)
        if m.kind != self.kind:
            raise CorruptRollout(rollout_id, str(path), f"manifest kind {m.kind!r} in the {self.kind!r} directory")
        return m

    def read(self, rollout_id: int) -> Rollout:
        """Read and verify a committed rollout. KeyError if not committed; CorruptRollout
        (naming the file) if the manifest or the data fails size/checksum/structure."""
        m = self.manifest(rollout_id)
        if m is None:
            listdir_fresh(self.dir)  # NFS: refresh before declaring it absent
            m = self.manifest(rollout_id)
            if m is None:
                raise KeyError(f"rollout {rollout_id} is not committed in {self.dir}")
        path = self.dir / m.data_file
        if m.checksum_alg != integrity.ALGORITHM:
            raise CorruptRollout(rollout_id, str(path), f"unknown checksum algorithm {m.checksum_alg!r}")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO would block the open
        except FileNotFoundError:
            raise CorruptRollout(rollout_id, str(path), "data file is missing") from None
        try:
            st = os.fstat(fd)
            size = st.st_size  # fresh after open on NFS (close-to-open)
            if not stat.S_ISREG(st.st_mode):
                raise CorruptRollout(rollout_id, str(path), "data file is not a regular file")
            if size != m.data_size:
                raise CorruptRollout(rollout_id, str(path), f"data file has {size} bytes, manifest says {m.data_size}")
            buf, bad = integrity.read_verified(fd, size, m.data_checksum)
        finally:
            os.close(fd)
        if bad is not None:
            raise CorruptRollout(
                rollout_id, str(path),
                f"checksum mismatch in block {bad} (bytes {bad * integrity.BLOCK}+): truncated or bit-flipped"
            )
        view = memoryview(buf)
        samples = codec.decode(view, str(path))
        if len(samples) != m.stats.n_samples:
            raise CorruptRollout(rollout_id, str(path), f"{len(samples)} samples, manifest says {m.stats.n_samples}")
        return Rollout(rollout_id=rollout_id, samples=samples, meta=m.meta, stats=m.stats, committed_at=m.committed_at)

    # Whether a damaged hint file may be set aside (buffer/atomic.py `read_hint`); a reader that must not
    # change the run (`rlslurm status`, `buffer ls`, a replay of another run) leaves it.
    repairs = True

    def last_trained(self) -> int | None:
        """Last rollout id covered by a trainer checkpoint (a hint for retention, regeneration and `ls`;
        the trainer's checkpoint is the authority). trained.json is written after each checkpoint; when
        it is absent or damaged (set aside with a warning), the newest complete checkpoint's own record
        says the same (`checkpoint_last_trained`)."""
        rec = read_hint(self.trained_file, set_aside_damaged=self.repairs)
        if rec is not None:
            last = rec.get("last_trained_rollout_id")
            if last is None or (isinstance(last, int) and not isinstance(last, bool)):
                return last
            log.warning("%s: last_trained_rollout_id %r is not an integer; using the checkpoints' record",
                        self.trained_file, last)
        return checkpoint_last_trained(self.run)

    def quarantined(self) -> list[dict]:
        """Quarantine records (reason.json contents + 'path'), oldest first. A reason.json that is
        missing or damaged (set aside with a warning) is rebuilt from its directory's name, which says
        the kind and the rollout id: the driver must still regenerate that rollout."""
        out = []
        for name in sorted(listdir_fresh(self.quarantine_dir)):
            rec = read_hint(self.quarantine_dir / name / "reason.json", set_aside_damaged=self.repairs)
            m = _QUARANTINE_RE.fullmatch(name)
            if not (rec is not None and isinstance(rec.get("rollout_id"), int) and isinstance(rec.get("kind"), str)):
                if m is None:
                    continue  # not a quarantine directory
                rec = {"rollout_id": int(m.group(2)), "kind": m.group(1), "reason": "(reason.json lost)"}
            if rec.get("kind") == self.kind:
                out.append({**rec, "path": str(self.quarantine_dir / name)})
        return out


def checkpoint_last_trained(run: RunDir) -> int | None:
    """The last trained rollout of the newest complete trainer checkpoint, from its completeness mark
    (RUN/checkpoints/latest -> iter_NNNNNNN/rlslurm.json `progress`, trainer/checkpoint/directory.py), else from
    the newest directory that has one; None without any. No torch: the rollout side reads it too."""
    root = run.checkpoints_dir
    names = [n for n in listdir_fresh(root) if n.startswith("iter_") and n[5:].isdigit()]
    latest = read_hint(root / "latest", set_aside_damaged=False)
    order = sorted(names, reverse=True)
    if latest is not None and isinstance(latest.get("name"), str) and latest["name"] in order:
        order.remove(latest["name"])
        order.insert(0, latest["name"])
    for name in order:
        try:
            meta = read_hint(root / name / "rlslurm.json", set_aside_damaged=False)
        except OSError:
            continue
        progress = meta.get("progress") if meta is not None else None
        last = progress.get("last_trained_rollout_id") if isinstance(progress, dict) else None
        if isinstance(last, int) and not isinstance(last, bool):
            return last
    return None
