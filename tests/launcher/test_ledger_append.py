"""The batch script's ledger appends are checked (rlslurm/templates/hetjob.sbatch.j2 `ledger_line`):
--max-failures is counted from the ledger, so an attempt whose line the filesystem refused must not
be requeued (its failure would go uncounted, and the job could requeue forever); a torn last line
never swallows the next; a refused requeue leaves one line for the attempt. The script's own
functions run in bash with a stand-in `scontrol`, without SLURM (test_slurm_job.py has the real
refused requeue)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from rlslurm.buffer.ledger import read_ledger
from rlslurm.buffer.rundir import RunDir
from rlslurm.settings.config import RunConfig
from rlslurm.slurm.render import render

FUNCTIONS = ("epoch", "log", "ledger_line", "end_attempt", "requeue")


def _functions(script: str) -> str:
    out = []
    for name in FUNCTIONS:
        m = re.search(rf"^{name}\(\) {{.*?^}}$|^{name}\(\) {{.*?}}$", script, re.MULTILINE | re.DOTALL)
        assert m, name
        out.append(m[0])
    return "\n".join(out)


def run_requeue(tmp_path: Path, ledger: Path, scontrol_rc: int) -> tuple[subprocess.CompletedProcess, list[str]]:
    """`requeue 1 "failed: ..."` of the rendered script, attempt 4; returns bash's result and the
    scontrol calls made."""
    script = render(RunConfig(), tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "scontrol.calls"
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "$*" >> {calls}\necho "Requested operation is presently '
                                      f'disabled"\nexit {scontrol_rc}\n')
    (bin_dir / "scontrol").chmod(0o755)
    sh = "\n".join([
        "set -uo pipefail", _functions(script),
        f"LEDGER={ledger}", f"RUN_DIR={tmp_path}", "SLURM_JOB_ID=77", "ATTEMPT=4", "TRAINER_NODES=n0",
        "ROLLOUT_NODES=n1", "ENDED=0", "TERM_AT=", "START_TS=1000",
        "REQUEUE_TRIES=2", "REQUEUE_PAUSE_S=0", "REQUEUE_WAIT_S=1",
        'requeue 1 "failed: trainer step ended first (trainer rc=1, rollout rc=143); requeue 1/3"',
    ])
    p = subprocess.run(["bash", "-c", sh], capture_output=True, text=True, timeout=60,
                       env={"PATH": f"{bin_dir}:/usr/bin:/bin"})
    return p, calls.read_text().splitlines() if calls.exists() else []


def test_a_refused_ledger_line_stops_the_requeue(tmp_path: Path) -> None:
    p, calls = run_requeue(tmp_path, Path("/dev/full"), scontrol_rc=0)  # every write: ENOSPC
    assert p.returncode == 1, p.stdout + p.stderr
    assert calls == []  # not requeued
    assert "No space left on device" in p.stderr
    assert "cannot append attempt 4's line" in p.stdout and "not requeueing" in p.stdout


def test_a_requeue_is_recorded_before_it_is_made(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_bytes(b'{"attempt": 3, "reason": "failed: x"}\n{"attempt": 3, "job_id": "7", "res')  # torn by a crash
    p, calls = run_requeue(tmp_path, ledger, scontrol_rc=0)
    assert p.returncode == 143, p.stdout + p.stderr  # SLURM's TERM never came: gave up waiting for it
    assert calls == ["requeue 77"]
    lines = read_ledger(RunDir(tmp_path))
    assert [(l["attempt"], l["reason"].split(";")[0]) for l in lines] == [
        (3, "failed: x"), (4, "failed: trainer step ended first (trainer rc=1, rollout rc=143)")]


def test_a_refused_requeue_leaves_one_line_saying_so(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger.jsonl"
    p, calls = run_requeue(tmp_path, ledger, scontrol_rc=1)
    assert p.returncode == 1 and calls == ["requeue 77", "requeue 77"], p.stdout + p.stderr
    [line] = [json.loads(l) for l in ledger.read_text().splitlines()]
    assert line["attempt"] == 4 and line["exit_code"] == 1
    assert line["reason"].startswith("requeue failed after 2 tries "
                                     "(scontrol: Requested operation is presently disabled")
    assert "was: failed: trainer step ended first" in line["reason"]


@pytest.mark.parametrize("torn", [b"", b'{"attempt": 1, "rea'])
def test_rlslurm_run_ledger_lines_are_whole(tmp_path: Path, torn: bytes) -> None:
    """`rlslurm run`'s runner (rlslurm/attempt.py) appends the same way: a torn line is ended first."""
    from rlslurm.attempt import append_ledger

    rd = RunDir.create(tmp_path / "run")
    rd.ledger.write_bytes(torn)
    append_ledger(rd, {"attempt": 2, "reason": "finished"})
    assert read_ledger(rd) == [{"attempt": 2, "reason": "finished"}]
