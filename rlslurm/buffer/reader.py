"""Trainer side: wait for rollout N, read it verified, quarantine it if corrupt.

A corrupt rollout (bad manifest, missing/short/long data, checksum mismatch) is never
handed to the trainer: `wait_for` logs the error (with the path), moves the rollout
into buffer/quarantine/ - which un-commits it, so the driver sees it must regenerate it
(`RolloutWriter.resume_point().to_regenerate`) - and keeps waiting for the new commit.

Replay (slime's --load-debug-rollout-data): `RolloutReader.replay(other_run)` reads
another run's buffer strictly read-only; corruption is then an error, not a quarantine.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Literal

from rlslurm.buffer.atomic import (
    Cancel,
    Cancelled,
    StorageError,
    ensure_dir,
    fsync_dir,
    is_cancelled,
    listdir_fresh,
    sleep_or_cancel,
    write_json_atomic,
)
from rlslurm.buffer.manifest import CorruptRollout, manifest_name
from rlslurm.buffer.rundir import RunDir
from rlslurm.buffer.sample import Rollout
from rlslurm.buffer.store import BufferStore
from rlslurm.errors import ConfigError, UserError

log = logging.getLogger(__name__)

DEFAULT_POLL_INTERVAL = 0.2


class BufferTimeout(UserError, TimeoutError):
    """No commit of the awaited rollout within the timeout."""


class ReadOnlyBuffer(UserError):
    """A write (quarantine, trained mark) was attempted on a replay buffer."""


OnCorrupt = Literal["quarantine", "wait", "raise"]


class RolloutReader(BufferStore):
    """Reads committed rollouts. What `wait_for` does with a corrupt one (`on_corrupt`):

    - "quarantine" (default for a writable reader: trainer rank 0) moves it aside and
      keeps waiting for the regenerated one;
    - "wait" (default for readonly=True: the other trainer ranks) logs it and keeps
      waiting while rank 0 quarantines it and the driver regenerates it;
    - "raise" (replay) raises CorruptRollout.
    """

    def __init__(
        self,
        run: RunDir | str | Path,
        *,
        kind: str = "train",
        readonly: bool = False,
        on_corrupt: OnCorrupt | None = None,
    ):
        super().__init__(run, kind=kind)
        self._require_dir()
        self.readonly = readonly
        self.repairs = not readonly  # a read-only reader leaves a damaged hint file where it is
        self.on_corrupt: OnCorrupt = on_corrupt or ("wait" if readonly else "quarantine")
        if self.on_corrupt not in ("quarantine", "wait", "raise"):
            raise ConfigError(f"on_corrupt must be quarantine, wait or raise, got {self.on_corrupt!r}")
        if readonly and self.on_corrupt == "quarantine":
            raise ConfigError("a read-only reader cannot quarantine (on_corrupt='quarantine')")
        self._not_retired: int | None = None  # the rollout `_check_not_retired` passed last

    @classmethod
    def replay(cls, run: RunDir | str | Path, *, kind: str = "train") -> "RolloutReader":
        """Open another run's buffer to train from it without any engine."""
        reader = cls(run, kind=kind, readonly=True, on_corrupt="raise")
        if not reader.committed_ids():
            raise ConfigError(f"{reader.dir}: replay buffer has no committed {kind} rollouts")
        return reader

    def wait_for(
        self,
        rollout_id: int,
        timeout: float | None = None,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
        cancel: Cancel = None,
    ) -> Rollout:
        """Block until rollout `rollout_id` is committed and verified, then return it.

        Raises BufferTimeout after `timeout` seconds (None: wait forever) and Cancelled
        when `cancel` (an Event or a callable returning True) fires. Every poll re-lists
        the directory, so a commit is seen within one poll interval even on NFS."""
        if poll_interval <= 0:
            raise ConfigError(f"buffer poll interval must be > 0, got {poll_interval}")
        deadline = None if timeout is None else time.monotonic() + timeout
        name = manifest_name(rollout_id)
        reported = ""
        while True:
            if is_cancelled(cancel):
                raise Cancelled()
            if name in listdir_fresh(self.dir):
                try:
                    return self.read(rollout_id)
                except KeyError:
                    pass  # retired or quarantined by someone else between list and read
                except CorruptRollout as e:
                    if self.on_corrupt == "raise":
                        raise
                    if self.on_corrupt == "quarantine":
                        log.error("%s; quarantining it, the driver will regenerate it", e)
                        self.quarantine(rollout_id, str(e))
                    elif str(e) != reported:
                        reported = str(e)
                        log.warning("%s; waiting for it to be quarantined and regenerated", e)
            else:
                self._check_not_retired(rollout_id)
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BufferTimeout(f"{self.dir}: rollout {rollout_id} was not committed within {timeout:g} s")
                sleep_or_cancel(min(poll_interval, left), cancel)
            else:
                sleep_or_cancel(poll_interval, cancel)

    def _check_not_retired(self, rollout_id: int) -> None:
        # Waiting for a rollout that was trained and retired would hang forever: the trainer
        # loaded no checkpoint retention kept rollouts for (every kept one unusable or deleted:
        # retention keeps what the oldest checkpoint on disk trains again, docs/buffer-retention.md).
        # Once per rollout awaited, not per poll (a listing of buffer/ and an open each: the trainer's
        # own checkpoints move trained.json, and it is waiting; docs/shared-fs-load.md).
        if self._not_retired == rollout_id:
            return
        last = self.last_trained()
        if last is not None and rollout_id <= last and not self.is_committed(rollout_id):
            raise ConfigError(
                f"{self.trained_file}: rollout {rollout_id} was already trained (last trained {last}) and retired "
                f"from {self.dir}; the trainer resumed from before the oldest kept checkpoint - "
                f"load the newest checkpoint or replay from an export"
            )
        self._not_retired = rollout_id

    def quarantine(self, rollout_id: int, reason: str) -> Path | None:
        """Move rollout `rollout_id` (manifest first: that un-commits it) and its data
        files into buffer/quarantine/<kind>-<id>-<stamp>/ with a reason.json. Returns
        that directory, or None if another process quarantined or retired it first."""
        if self.readonly:
            raise ReadOnlyBuffer(f"{self.dir}: cannot quarantine rollout {rollout_id} in a read-only (replay) buffer")
        qdir = self.quarantine_dir / f"{self.kind}-{rollout_id:08d}-{int(time.time())}-{secrets.token_hex(3)}"
        prefix = f"{rollout_id:08d}."
        # Data files present before the manifest goes belong to this (or an older) commit;
        # a regeneration can only start after it, and its new file must not be moved.
        old_data = [n for n in listdir_fresh(self.dir) if n.startswith(prefix) and n.endswith(".data")]
        try:
            ensure_dir(qdir)
            # the record first: if we die below, the driver still learns it must regenerate
            write_json_atomic(
                qdir / "reason.json",
                {"rollout_id": rollout_id, "kind": self.kind, "reason": reason, "quarantined_at": time.time(),
                 "pid": os.getpid()},
            )
            try:
                os.rename(self.manifest_path(rollout_id), qdir / "manifest.json")
            except FileNotFoundError:
                shutil.rmtree(qdir, ignore_errors=True)
                return None
            fsync_dir(self.dir)
            for n in old_data:
                try:
                    os.rename(self.dir / n, qdir / n)
                except FileNotFoundError:
                    pass
            fsync_dir(self.dir)
        except OSError as e:
            raise StorageError(f"{qdir}: cannot quarantine rollout {rollout_id}: {e.strerror or e}") from e
        log.warning("quarantined rollout %d into %s: %s", rollout_id, qdir, reason)
        return qdir
