"""The run directory: the only state the two het groups share and the only thing
that survives a requeue. This module knows its layout and its permissions."""

from __future__ import annotations

import logging
import os
import secrets
import stat
import time
from pathlib import Path

from rlslurm.buffer.atomic import (
    DEFAULT_FILE_MODE,
    CorruptRecord,
    ensure_dir,
    exists_fresh,
    listdir_fresh,
    publish_exclusive,
    read_bytes,
    read_bytes_ino,
    read_hint,
    set_aside,
    write_json_atomic,
)
from rlslurm.errors import ConfigError

log = logging.getLogger(__name__)

MARKER = ".rlslurm-run"
FORMAT_VERSION = 1
PRIVATE_DIR_MODE = 0o700
# setgid so files created later inherit the group, not the creator's primary group
GROUP_DIR_MODE = 0o750 | stat.S_ISGID
SUBDIRS = ("control", "buffer", "weights", "checkpoints", "logs", "tb")


def usable_refusal(path: Path) -> str | None:
    """Why `path` cannot become (or be) a run directory, from what exists now; None if it can: it is a
    directory this user may write, or its nearest existing ancestor is."""
    p = Path(os.path.abspath(path))
    probe = p
    while not os.path.lexists(probe) and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is not a directory" if probe != p else "exists and is not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{'it' if probe == p else probe} is not writable by you"
    return None


def _key_of(data: bytes) -> str | None:
    """The api key in control/api_key's bytes, None if they are not one: at least 32 printable ASCII
    characters, no space. rlslurm writes 64 hex digits; a site's key of another alphabet (a job's own,
    or a test deployment's) is a key too. What damage leaves - nothing, NULs, a cut-off line - is not."""
    key = data.decode("ascii", errors="replace").strip()
    return key if len(key) >= 32 and key.isascii() and key.isprintable() and not any(c.isspace() for c in key) \
        else None


class RunDir:
    """Paths inside one run directory. The constructor does no I/O."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    @classmethod
    def create(cls, path: str | Path, *, group_shared: bool = False) -> "RunDir":
        """Create (or re-open) a run directory, private to the user (0700), or readable by
        the group (2750) when `group_shared`. Modes are set with chmod, so the umask
        does not matter. A non-empty directory that is not a run directory is refused."""
        rd = cls(path)
        mode = GROUP_DIR_MODE if group_shared else PRIVATE_DIR_MODE
        if rd.path.exists() and not rd.path.is_dir():
            raise ConfigError(f"run directory {rd.path}: exists and is not a directory")
        entries = listdir_fresh(rd.path) if rd.path.is_dir() else []
        if entries and MARKER not in entries:
            raise ConfigError(
                f"run directory {rd.path}: exists, is not empty and is not an rlslurm run directory "
                f"(no {MARKER}); pick a new path or empty it"
            )
        try:
            rd.path.mkdir(parents=True, exist_ok=True)
            os.chmod(rd.path, mode)
            for sub in SUBDIRS:
                d = rd.path / sub
                d.mkdir(exist_ok=True)
                os.chmod(d, mode)
        except OSError as e:  # a file on its path, a read-only or foreign place: one line
            named = e.filename and str(e.filename) != str(rd.path)
            raise ConfigError(f"run directory {rd.path}: cannot make it: {e.strerror or e}"
                              f"{f' ({e.filename})' if named else ''}") from None
        if MARKER not in entries:
            write_json_atomic(
                rd.path / MARKER,
                {"format": FORMAT_VERSION, "created_at": time.time(), "group_shared": group_shared},
            )
        return rd

    def is_run_dir(self) -> bool:
        return exists_fresh(self.path / MARKER)

    def private_file_mode(self) -> int:
        """The mode a file written often needs here: 0600 in a private run (0700: a file's group bits are
        moot where the group cannot enter), DEFAULT_FILE_MODE (0640) in a group-shared one. Under the
        job's umask 077 a 0640 file costs a chmod, a metadata round trip, at every write (buffer/atomic.py
        `_write_tmp`; heartbeats: docs/shared-fs-load.md). One stat of the run directory."""
        return DEFAULT_FILE_MODE if os.stat(self.path).st_mode & 0o070 else 0o600

    # --- layout -------------------------------------------------------------------------
    @property
    def run_yaml(self) -> Path:
        return self.path / "run.yaml"

    @property
    def job_sbatch(self) -> Path:
        return self.path / "job.sbatch"

    @property
    def ledger(self) -> Path:
        return self.path / "ledger.jsonl"

    @property
    def control_dir(self) -> Path:
        return self.path / "control"

    @property
    def buffer_dir(self) -> Path:
        return self.path / "buffer"

    @property
    def weights_dir(self) -> Path:
        return self.path / "weights"

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / "checkpoints"

    @property
    def logs_dir(self) -> Path:
        return self.path / "logs"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def tb_dir(self) -> Path:
        return self.path / "tb"

    @property
    def finished(self) -> Path:
        return self.path / "FINISHED"

    @property
    def api_key_file(self) -> Path:
        return self.control_dir / "api_key"

    def attempt_log_dir(self, attempt: int) -> Path:
        """logs/attempt-<n>, n = the run's attempt number (0 for the first; buffer/attempts.py)."""
        if attempt < 0:
            raise ConfigError(f"attempt number must be >= 0, got {attempt}")
        return self.logs_dir / f"attempt-{attempt}"

    # --- api key ------------------------------------------------------------------------
    def ensure_api_key(self) -> str:
        """Create control/api_key (0600) once, exclusively; every caller gets the same key. One damaged on
        disk (not the 64 hex digits rlslurm writes) is set aside with a warning and made anew: the key only
        has to be the same for the processes of one attempt, which all start after this."""
        key = secrets.token_hex(32)  # hex: never starts with '-' (argv parsers), no quoting needed
        ensure_dir(self.control_dir)
        publish_exclusive(self.api_key_file, (key + "\n").encode(), mode=0o600)
        got = read_bytes_ino(self.api_key_file)
        if got is not None and _key_of(got[0]) is None:
            aside = set_aside(self.api_key_file, got[1])
            if aside is not None:
                log.warning("%s: damaged on disk; set aside as %s and made anew", self.api_key_file, aside.name)
            publish_exclusive(self.api_key_file, (key + "\n").encode(), mode=0o600)
        return self.api_key()

    def api_key(self) -> str:
        data = read_bytes(self.api_key_file)
        if data is None:
            raise ConfigError(f"{self.api_key_file}: api key file is missing "
                              "(was the run directory created by rlslurm?)")
        key = _key_of(data)
        if key is None:  # the run wrote it itself: the filesystem's doing, rebuilt by the next attempt
            raise CorruptRecord(f"{self.api_key_file}: damaged on disk (not the key rlslurm writes); the rollout "
                                f"node of the next attempt makes a new one; this attempt fails and is requeued "
                                f"(--max-failures)")
        return key

    # --- completion -----------------------------------------------------------------------
    def is_finished(self) -> bool:
        return exists_fresh(self.finished)

    def mark_finished(self, info: dict) -> None:
        write_json_atomic(self.finished, {"finished_at": time.time(), **info})

    def finished_info(self) -> dict | None:
        """FINISHED's record; None when absent or damaged (then with a warning: the run is finished all
        the same, `is_finished` goes by the name)."""
        return read_hint(self.finished, set_aside_damaged=False)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def __fspath__(self) -> str:
        return str(self.path)
