"""A user error found on a node ends the job: recorded, not retried.

Most bad input is refused at submit (rlslurm/resolve.py, rlslurm/preflight.py). What only a node can
find — a plugin that imports only in the job's environment, a chat template that raises on the
node's tokenizer, a flag the node's SGLang refuses, a file that vanished after submit — is a
`UserError` raised in a role (trainer rank, rollout node). A retry would fail the same way after
another queue wait, so the role records the one-line message in
`RUN/logs/attempt-N/user_error.json` and exits with USER_ERROR_EXIT_CODE; the batch script
(sbatch_templates/hetjob.sbatch.j2) and `rlslurm run` (rlslurm/local.py) then end the job with
that code and the ledger reason "user error: <message>", without requeueing
(docs/user-errors.md). Exit codes alone cannot carry this: torchrun reports any failed worker as 1.

The file's first key is "reason", a JSON string with only ASCII in it (escaped by json.dumps), so
the batch shell can copy the escaped text into its ledger line with one sed expression.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, NoReturn

from rlslurm import exit_guard
from rlslurm.errors import UserError

USER_ERROR_EXIT_CODE = 3        # 2 is the CLI's (and argparse's) usage error
USER_ERROR_FILE = "user_error.json"
REASON_PREFIX = "user error: "
MAX_MESSAGE_CHARS = 1000        # a ledger line stays a line a person reads


def attempt_dir(run_dir: Path) -> Path:
    from rlslurm.buffer.rundir import RunDir
    from rlslurm.job.env import job_env

    return RunDir(run_dir).attempt_log_dir(job_env().attempt)


# A failure that is not the user's but has a cause worth a line of its own (the run directory's
# filesystem full or failing, buffer/atomic.py StorageError): recorded the same way, best effort (a
# full disk may refuse it too), and the batch script puts it in the ledger's "failed: ..." reason.
# The attempt is requeued as any failure.
FAILURE_FILE = "failure.json"


def _record(run_dir: Path, role: str, error: BaseException, name: str, prefix: str) -> Path:
    """Write this attempt's record `name` (the first writer wins: every trainer rank may fail the
    same way at once)."""
    from rlslurm.buffer.atomic import publish_exclusive

    message = " ".join(str(error).split())  # one line
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[:MAX_MESSAGE_CHARS] + "..."
    rec = {"reason": prefix + message, "role": role,
           "rank": int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or 0),
           "host": os.uname().nodename, "error": type(error).__name__, "at": time.time()}
    path = attempt_dir(run_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    publish_exclusive(path, (json.dumps(rec, ensure_ascii=True) + "\n").encode())
    return path


def record_user_error(run_dir: Path, role: str, error: BaseException) -> Path:
    return _record(run_dir, role, error, USER_ERROR_FILE, REASON_PREFIX)


def record_failure(run_dir: Path, role: str, error: BaseException) -> Path:
    return _record(run_dir, role, error, FAILURE_FILE, "")


def _read(attempt_log_dir: Path, name: str) -> dict[str, Any] | None:
    try:
        rec = json.loads((attempt_log_dir / name).read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("reason"), str) else None


def read_user_error(attempt_log_dir: Path) -> dict[str, Any] | None:
    return _read(attempt_log_dir, USER_ERROR_FILE)


def read_failure(attempt_log_dir: Path) -> dict[str, Any] | None:
    return _read(attempt_log_dir, FAILURE_FILE)


FAILURE_EXIT_CODE = 1  # an attempt's failure: requeued within --max-failures


def run_role(role: str, main: Callable[[list[str] | None], int], run_dir_of: Callable[[list[str]], Path]) -> NoReturn:
    """A role's `__main__`: exit with main()'s status; on a UserError print it, record it and exit
    with USER_ERROR_EXIT_CODE. The run directory's filesystem failing (full, or a transient error
    that outlasted its retries: buffer/atomic.py StorageError) is no user error: one line, and the
    attempt fails (docs/shared-filesystem.md, "When the filesystem fails")."""
    from rlslurm.buffer.atomic import StorageError

    try:
        status = main(None)
    except StorageError as e:
        print(f"rlslurm {role}: error: {e}", file=sys.stderr, flush=True)
        try:
            record_failure(run_dir_of(sys.argv[1:]), role, e)
        except Exception as rec_err:  # the filesystem that failed may refuse this too
            print(f"rlslurm {role}: could not record the failure: {rec_err!r}", file=sys.stderr)
        print(f"rlslurm {role}: this attempt fails (requeued within --max-failures)", file=sys.stderr, flush=True)
        exit_guard.exit(FAILURE_EXIT_CODE)
    except UserError as e:
        print(f"rlslurm {role}: error: {e}", file=sys.stderr)
        try:
            where = record_user_error(run_dir_of(sys.argv[1:]), role, e)
            print(f"rlslurm {role}: recorded in {where}; the job ends without requeue", file=sys.stderr)
        except Exception as rec_err:  # the run dir itself may be what is wrong
            print(f"rlslurm {role}: could not record the user error: {rec_err!r}", file=sys.stderr)
        exit_guard.exit(USER_ERROR_EXIT_CODE)
    exit_guard.exit(status)  # a thread left blocked in c10d must not abort the exit (exit_guard.py)


def run_dir_arg(argv: list[str]) -> Path:
    """--run-dir of a role's argv (both roles take it)."""
    for i, a in enumerate(argv):
        if a == "--run-dir" and i + 1 < len(argv):
            return Path(argv[i + 1])
        if a.startswith("--run-dir="):
            return Path(a.split("=", 1)[1])
    raise ValueError("no --run-dir in the arguments")
