"""Rollout driver side: commit rollout N, all or nothing.

Commit protocol (docs/shared-filesystem.md, "Commit and visibility"):
1. validate the samples (a bad sample is a DataError naming rollout and sample);
2. write the data file under a temp name, fsync, rename onto a name unique to this
   commit (`<id>.<nonce>.data`) - a crashed or zombie writer never collides with us;
3. write the manifest (data file name, size, checksum, metadata, stats) and publish it
   exclusively (hard link, see atomic.publish_exclusive). This is the commit point:
   before it readers see nothing, after it they see everything. If another writer
   published the same id first we lose cleanly and remove our data file.
A crash anywhere leaves at worst an unreferenced data or temp file, removed by
`cleanup()`; the previously committed state is never touched.

Hand-back: a driver stopped in the middle of a rollout (preempt, stop) has drawn prompts
and generated tokens that no commit records. `save_handback` writes the data cursor as
it is after the stop (those prompts pending, with their partial samples) into
`buffer/<kind>-handback.json`, tied to the newest commit it continues from; the next
`resume_point` uses it only while that commit is still the newest, so a cursor is never
applied twice and a later commit always wins.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlslurm.buffer import codec, integrity
from rlslurm.buffer.atomic import (
    NotARecord,
    StorageError,
    ensure_dir,
    fsync_dir,
    is_tmp_name,
    listdir_fresh,
    publish_exclusive,
    read_hint,
    read_regular,
    retry_transient,
    unlink_durable,
    write_json_atomic,
    write_tmp,
)
from rlslurm.buffer.manifest import Manifest, data_name, parse_data_name
from rlslurm.buffer.rundir import RunDir
from rlslurm.buffer.sample import RolloutMeta, RolloutStats, Sample
from rlslurm.buffer.store import MAX_MANIFEST_BYTES, BufferStore
from rlslurm.errors import DataError, UserError

log = logging.getLogger(__name__)


class AlreadyCommitted(UserError):
    """Rollout N has a manifest already: it is immutable until trained and retired or
    quarantined."""


@dataclass
class ResumePoint:
    """Where a (re)started driver continues."""

    next_rollout_id: int
    data_cursor: dict[str, Any]  # cursor after the last committed rollout ({} at start)
    to_regenerate: list[int] = field(default_factory=list)  # quarantined, not re-committed
    from_handback: bool = False  # data_cursor is the hand-back of a driver stopped after that commit


@dataclass
class CommitInfo:
    rollout_id: int
    manifest_path: Path
    data_path: Path
    data_size: int
    committed_at: float


class RolloutWriter(BufferStore):
    """The single writer of one run's rollouts (the rollout driver)."""

    def __init__(self, run: RunDir | str | Path, *, kind: str = "train", attempt: int | None = None):
        super().__init__(run, kind=kind)
        self._require_dir()
        ensure_dir(self.dir)
        self.attempt = attempt if attempt is not None else int(os.environ.get("SLURM_RESTART_COUNT", "0"))

    def commit(self, rollout_id: int, samples: list[Sample], meta: RolloutMeta | None = None) -> CommitInfo:
        """Commit rollout `rollout_id`, all or nothing. Raises DataError (naming rollout
        and sample) for bad input, AlreadyCommitted if the id exists, StorageError (naming
        the file) if the filesystem refuses - in every case nothing is committed and the
        previously committed rollouts are untouched."""
        meta = meta or RolloutMeta(kind=self.kind)  # type: ignore[arg-type]
        meta.validate(f"rollout {rollout_id} meta")
        if meta.kind != self.kind:
            raise DataError(f"rollout {rollout_id}",
                            f"meta.kind is {meta.kind!r} but this writer commits {self.kind!r}")
        if rollout_id < 0:
            raise DataError(f"rollout {rollout_id}", "rollout id must be >= 0")
        if not samples:
            raise DataError(f"rollout {rollout_id}", "a rollout needs at least one sample")
        for i, s in enumerate(samples):
            s.validate(f"rollout {rollout_id} sample {i}")
        if self.is_committed(rollout_id):
            raise AlreadyCommitted(f"{self.manifest_path(rollout_id)}: rollout {rollout_id} is already committed")

        enc = codec.encode(samples)
        pending_crc = integrity.block_checksums_async(enc.chunks, enc.size)  # overlaps the write
        data_path = self.dir / data_name(rollout_id, secrets.token_hex(6))
        tmp = write_tmp(data_path, enc.chunks)
        crc = pending_crc if isinstance(pending_crc, list) else pending_crc.result()
        try:
            # No directory fsync here: the one after the manifest link below persists
            # this entry too (same directory), and journaled/NFS/Lustre/GPFS metadata is
            # ordered, so the manifest cannot survive a crash without its data name.
            retry_transient(lambda: os.replace(tmp, data_path), data_path, "committing the data file")
        except OSError as e:
            _unlink_quiet(tmp)
            raise StorageError(f"{data_path}: cannot commit: {e.strerror or e}") from e
        except StorageError:
            _unlink_quiet(tmp)
            raise

        stats = RolloutStats.of(samples)
        if not meta.weight_versions:
            meta = dataclasses.replace(meta, weight_versions=list(stats.weight_versions))
        committed_at = time.time()
        manifest = Manifest(
            rollout_id=rollout_id,
            kind=self.kind,
            committed_at=committed_at,
            data_file=data_path.name,
            data_size=enc.size,
            data_checksum=crc,
            checksum_alg=integrity.ALGORITHM,
            meta=meta,
            stats=stats,
            writer={"host": socket.gethostname(), "pid": os.getpid(), "attempt": self.attempt},
        )
        try:
            won = publish_exclusive(self.manifest_path(rollout_id), manifest.to_bytes())
        except BaseException:
            _unlink_quiet(data_path)
            raise
        if not won:
            _unlink_quiet(data_path)
            raise AlreadyCommitted(
                f"{self.manifest_path(rollout_id)}: another writer committed rollout {rollout_id} first"
            )
        return CommitInfo(rollout_id, self.manifest_path(rollout_id), data_path, enc.size, committed_at)

    def resume_point(self) -> ResumePoint:
        """Next id and data cursor for a (re)started driver, from what is on disk.

        The cursor is the one saved with the most recently committed rollout (by commit
        time, so a regenerated rollout's newer cursor wins over a higher id's), looking
        into quarantined manifests too: quarantining the newest rollout must not send
        the driver back to the start of the data. A hand-back saved after that commit
        (a stop mid-rollout) replaces it."""
        ids = self.committed_ids()
        newest = self._newest_manifest(ids)
        top = ids[-1] if ids else -1
        for q in self.quarantined():
            top = max(top, q["rollout_id"])
        last_trained = self.last_trained()
        if last_trained is not None:
            top = max(top, last_trained)
        cursor = dict(newest.meta.data_cursor) if newest is not None else {}
        handback = read_hint(self.handback_file)  # damaged: set aside with a warning, the commit's cursor used
        if handback is not None and not isinstance(handback.get("data_cursor"), dict):
            log.warning("%s: no data cursor in it; ignored", self.handback_file)
            handback = None
        from_handback = handback is not None and handback.get("base") == _identity(newest)
        if from_handback:
            cursor = dict(handback["data_cursor"])  # type: ignore[index]
        elif handback is not None:
            log.info("%s: stale (saved after %s, newest commit %s): ignored", self.handback_file,
                     handback.get("base"), _identity(newest))
        return ResumePoint(
            next_rollout_id=top + 1,
            data_cursor=cursor,
            to_regenerate=self.to_regenerate(ids),
            from_handback=from_handback,
        )

    def _newest_manifest(self, ids: list[int]) -> Manifest | None:
        newest: Manifest | None = None
        for rid in ids:
            try:
                m = self.manifest(rid)
            except DataError:
                continue  # corrupt: the trainer will quarantine it
            if m is not None and (newest is None or m.committed_at > newest.committed_at):
                newest = m
        for q in self.quarantined():
            m = _quarantined_manifest(Path(q["path"]), q["rollout_id"])
            if m is not None and (newest is None or m.committed_at > newest.committed_at):
                newest = m
        return newest

    # ------------------------------------------------------------------ hand-back

    @property
    def handback_file(self) -> Path:
        return self.run.buffer_dir / f"{self.kind}-handback.json"

    def save_handback(self, data_cursor: dict[str, Any]) -> Path:
        """Record the cursor of a driver stopped mid-rollout (see the module docstring)."""
        write_json_atomic(self.handback_file, {
            "base": _identity(self._newest_manifest(self.committed_ids())),
            "data_cursor": data_cursor,
            "saved_at": time.time(),
            "attempt": self.attempt,
        })
        return self.handback_file

    def clear_handback(self) -> None:
        """After a commit the hand-back is stale; remove it so nobody reads it by mistake."""
        unlink_durable(self.handback_file)

    def to_regenerate(self, committed_ids: list[int] | None = None) -> list[int]:
        """Ids the trainer quarantined as corrupt and nobody re-committed yet: the driver
        regenerates them (poll this between rollouts; it is one directory listing)."""
        committed = set(self.committed_ids() if committed_ids is None else committed_ids)
        last_trained = self.last_trained()
        done = -1 if last_trained is None else last_trained  # regenerated, trained and retired since
        return sorted({q["rollout_id"] for q in self.quarantined()
                       if q["rollout_id"] not in committed and q["rollout_id"] > done})

    def cleanup(self, *, min_age_s: float = 600.0) -> list[Path]:
        """Remove temp files and data files no manifest references, older than
        `min_age_s` (a live writer's files are seconds old). Returns what was removed."""
        names = listdir_fresh(self.dir)
        referenced = set()
        for rid in self.committed_ids():
            try:
                m = self.manifest(rid)
            except DataError:
                continue  # the reader will quarantine it; keep its data for the post-mortem
            if m is not None:
                referenced.add(m.data_file)
        now = time.time()
        removed = []
        for name in names:
            if not (is_tmp_name(name) or (parse_data_name(name) is not None and name not in referenced)):
                continue
            path = self.dir / name
            try:
                if now - path.stat().st_mtime < min_age_s:
                    continue
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                continue
        if removed:
            fsync_dir(self.dir)
            log.info("buffer cleanup removed %d orphan files in %s", len(removed), self.dir)
        return removed


def _identity(m: Manifest | None) -> dict[str, Any] | None:
    """Which commit a hand-back continues from (None: nothing committed yet)."""
    return None if m is None else {"rollout_id": m.rollout_id, "committed_at": m.committed_at}


def _quarantined_manifest(qdir: Path, rollout_id: int) -> Manifest | None:
    try:
        got = read_regular(qdir / "manifest.json", MAX_MANIFEST_BYTES)  # a FIFO moved there: never waited on
        return None if got is None else Manifest.from_bytes(got[0], qdir / "manifest.json", rollout_id)
    except (OSError, DataError, NotARecord):
        return None  # torn manifest, or the quarantine never got to move it


def _unlink_quiet(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
