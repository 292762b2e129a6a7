"""Tolerant reader of RUN/ledger.jsonl (appended by the batch script, one line per attempt).

Appends from bash are not atomic on shared filesystems, so a line may be torn by a
crash or a concurrent append; such lines are skipped and reported, never fatal. So is a line whose
known field has the wrong type (a hand edit, a foreign writer): every reader (status, resubmit, the
failure budget) compares and counts these fields.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from rlslurm.buffer.atomic import read_bytes
from rlslurm.buffer.rundir import RunDir
from rlslurm.buffer.store import as_rundir

log = logging.getLogger(__name__)


# The fields rlslurm writes (rlslurm/attempt.py LEDGER_FIELDS, buffer/attempts.py `record_resubmit`)
# and their types; others are kept as they are.
FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "attempt": (int,), "job_id": (str,), "restart_count": (int,), "start": (int, float), "end": (int, float),
    "exit_code": (int,), "reason": (str,), "trainer_nodes": (str,), "rollout_nodes": (str,), "checkpoint": (int,),
    "event": (str,), "next_attempt": (int,), "reset_failures": (bool,), "at": (int, float)}


def _wrong_field(obj: dict) -> str | None:
    for k, types in FIELD_TYPES.items():
        if k in obj and (not isinstance(obj[k], types) or (isinstance(obj[k], bool) and bool not in types)):
            return (f"field {k!r} is {json.dumps(obj[k])[:40]}, not {' or '.join(t.__name__ for t in types)}; "
                    f"skipped")
    return None


@dataclass
class LedgerProblem:
    where: str  # path:line
    message: str


def read_ledger(run: RunDir | str | Path, problems: list[LedgerProblem] | None = None) -> list[dict]:
    """Every well-formed JSON object line of the ledger, in order. Torn or foreign
    lines are logged as warnings naming path:line and appended to `problems`."""
    rd = as_rundir(run)
    data = read_bytes(rd.ledger)
    if data is None:
        return []
    out = []
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        where = f"{rd.ledger}:{lineno}"
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            _report(problems, where, f"torn or invalid line skipped ({e.__class__.__name__}: {e})")
            continue
        if not isinstance(obj, dict):
            _report(problems, where, f"expected a JSON object, found {type(obj).__name__}; skipped")
            continue
        if (wrong := _wrong_field(obj)) is not None:
            _report(problems, where, wrong)
            continue
        out.append(obj)
    return out


def _report(problems: list[LedgerProblem] | None, where: str, message: str) -> None:
    log.warning("%s: %s", where, message)
    if problems is not None:
        problems.append(LedgerProblem(where, message))
