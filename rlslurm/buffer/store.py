"""Read-side view of one buffer directory, shared by the writer, the reader and the CLI."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rlslurm.buffer import codec
from rlslurm.buffer.atomic import listdir_fresh, read_json
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

TRAINED_FILE = "trained.json"
QUARANTINE_DIR = "quarantine"


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
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        m = Manifest.from_bytes(data, path, rollout_id)
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
        if m.checksum_alg != codec.CHECKSUM:
            raise CorruptRollout(rollout_id, str(path), f"unknown checksum algorithm {m.checksum_alg!r}")
        # one byte more than expected: a file that grew is as wrong as one that shrank;
        # np.empty, unlike bytearray, does not zero-fill ~10 MB before reading over it
        buf = np.empty(m.data_size + 1, dtype=np.uint8)
        try:
            with open(path, "rb", buffering=0) as f:
                n = _readinto_full(f, buf)
        except FileNotFoundError:
            raise CorruptRollout(rollout_id, str(path), "data file is missing") from None
        if n != m.data_size:
            raise CorruptRollout(rollout_id, str(path), f"data file has {n}{'+' if n > m.data_size else ''} bytes, manifest says {m.data_size}")
        view = memoryview(buf)[:n]
        got = codec.checksum(view)
        if got != m.data_checksum:
            raise CorruptRollout(rollout_id, str(path), f"checksum {got} != {m.data_checksum} in manifest (truncated or bit-flipped)")
        samples = codec.decode(view, str(path))
        if len(samples) != m.stats.n_samples:
            raise CorruptRollout(rollout_id, str(path), f"{len(samples)} samples, manifest says {m.stats.n_samples}")
        return Rollout(rollout_id=rollout_id, samples=samples, meta=m.meta, stats=m.stats, committed_at=m.committed_at)

    def last_trained(self) -> int | None:
        """Last rollout id covered by a trainer checkpoint (a hint for retention and `ls`;
        the trainer's checkpoint is the authority)."""
        rec = read_json(self.trained_file)
        return None if rec is None else rec.get("last_trained_rollout_id")

    def quarantined(self) -> list[dict]:
        """Quarantine records (reason.json contents + 'path'), oldest first."""
        out = []
        for name in sorted(listdir_fresh(self.quarantine_dir)):
            rec = read_json(self.quarantine_dir / name / "reason.json")
            if rec is not None and rec.get("kind") == self.kind:
                out.append({**rec, "path": str(self.quarantine_dir / name)})
        return out


def _readinto_full(f, buf: np.ndarray) -> int:
    view = memoryview(buf)
    total = 0
    while total < len(buf):
        n = f.readinto(view[total:])
        if not n:
            break
        total += n
    return total


