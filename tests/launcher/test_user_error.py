"""A user error found on a node: the record a role writes, and the batch script's copy of it into
the ledger (JSON-escaped exactly), without SLURM (tests/slurm/test_slurm_job.py has the real job)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlslurm.buffer.rundir import RunDir
from rlslurm.errors import ConfigError
from rlslurm.settings.config import RunConfig
from rlslurm.slurm.render import render
from rlslurm.user_error import USER_ERROR_EXIT_CODE, USER_ERROR_FILE, read_user_error, record_user_error

NASTY = 'chat template failed: TemplateError: "role" must be \\user\\ or $(touch pwned)\n  ünïcode\t%s {}'


@pytest.fixture
def attempt_env(monkeypatch) -> None:
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    monkeypatch.setenv("RLSLURM_ATTEMPT", "2")


def test_record_is_one_ascii_line_the_first_writer_wins(tmp_path: Path, attempt_env) -> None:
    p = record_user_error(tmp_path, "rollout", ConfigError(NASTY))
    assert p == RunDir(tmp_path).attempt_log_dir(2) / USER_ERROR_FILE
    text = p.read_text()
    assert text.isascii() and text.count("\n") == 1 and text.startswith('{"reason": "user error: ')
    assert read_user_error(p.parent)["reason"] == "user error: " + " ".join(NASTY.split())
    record_user_error(tmp_path, "trainer", ConfigError("another rank"))
    assert read_user_error(p.parent)["role"] == "rollout"


def test_batch_script_copies_the_reason_into_a_valid_ledger_line(tmp_path: Path, attempt_env) -> None:
    script = render(RunConfig(), tmp_path)
    job = tmp_path / "job.sbatch"
    job.write_text(script)
    subprocess.run(["bash", "-n", str(job)], check=True)  # the whole script parses
    [sed] = re.findall(r"^\s*REASON=\$\((sed .*)\)$", script, re.MULTILINE)
    p = record_user_error(tmp_path, "rollout", ConfigError(NASTY))
    sh = f'REASON=$({sed.replace(chr(36) + "LOG_DIR", str(p.parent))}); printf \'{{"reason": "%s"}}\\n\' "$REASON"'
    line = subprocess.run(["bash", "-c", sh], capture_output=True, text=True, check=True).stdout
    assert json.loads(line)["reason"] == read_user_error(p.parent)["reason"]
    assert not (tmp_path / "pwned").exists()
    fallback = subprocess.run(["bash", "-c", re.search(r'end_attempt \d+ ("\$\{REASON:-[^\n]*")', script)[1]
                               .join(["R=; echo ", ""]).replace("REASON", "R")], capture_output=True, text=True)
    assert fallback.stdout.startswith("user error: ") and json.loads(f'"{fallback.stdout.strip()}"'), fallback
    assert f"exit {USER_ERROR_EXIT_CODE}\n" in script and f'end_attempt {USER_ERROR_EXIT_CODE} "$' in script


def test_a_role_that_raises_a_user_error_records_it_and_exits_with_the_code(tmp_path: Path) -> None:
    code = ("import sys\nfrom rlslurm.errors import DataError\nfrom rlslurm.user_error import run_dir_arg, run_role\n"
            "def main(argv=None):\n    raise DataError('p.jsonl:3', 'chat template failed')\n"
            "run_role('rollout', main, run_dir_arg)\n")
    env = {"PATH": "/usr/bin:/bin", "RLSLURM_ATTEMPT": "0", "PYTHONPATH": str(Path(__file__).parents[2])}
    p = subprocess.run([sys.executable, "-c", code, "--run-dir", str(tmp_path)], capture_output=True, text=True,
                       env=env, timeout=60)
    assert p.returncode == USER_ERROR_EXIT_CODE, p.stderr
    assert "rlslurm rollout: error: p.jsonl:3: chat template failed" in p.stderr
    rec = read_user_error(RunDir(tmp_path).attempt_log_dir(0))
    assert rec["reason"] == "user error: p.jsonl:3: chat template failed" and rec["error"] == "DataError"


def test_status_reports_the_user_error_of_the_last_attempt(tmp_path: Path, attempt_env) -> None:
    from rlslurm.slurm.status import run_status

    rd = RunDir(tmp_path)
    record_user_error(tmp_path, "trainer", ConfigError("--megatron-x: not a field"))
    line = {"attempt": 2, "job_id": "7", "exit_code": USER_ERROR_EXIT_CODE,
            "reason": "user error: --megatron-x: not a field"}
    rd.ledger.write_text(json.dumps({"attempt": 1, "reason": "failed: trainer"}) + "\n" + json.dumps(line) + "\n")
    st = run_status(tmp_path, query_slurm=False)
    assert st.user_error["reason"] == line["reason"] and st.user_error["role"] == "trainer"
    rd.ledger.write_text(rd.ledger.read_text() + json.dumps({"attempt": 3, "reason": "finished"}) + "\n")
    assert run_status(tmp_path, query_slurm=False).user_error is None


def test_a_recorded_failure_becomes_the_failed_reason_and_is_requeued(tmp_path: Path, attempt_env) -> None:
    """A role that failed for a cause of its own (the run directory's filesystem: buffer/atomic.py
    StorageError) records it in failure.json; the batch script puts that line, escaped exactly, into
    the ledger's "failed: ..." reason, which counts against --max-failures (no user error)."""
    from rlslurm.buffer.atomic import StorageFull
    from rlslurm.user_error import FAILURE_FILE, read_failure, record_failure

    script = render(RunConfig(), tmp_path)
    [block] = re.findall(r'^if \[ -e "\$LOG_DIR/' + re.escape(FAILURE_FILE) + r'" \]; then\n.*?^fi$', script,
                         re.MULTILINE | re.DOTALL)
    p = record_failure(tmp_path, "trainer", StorageFull(NASTY))
    sh = "\n".join([f"LOG_DIR={p.parent}", 'WHY="trainer step ended first (trainer rc=1, rollout rc=143)"', block,
                    'printf \'{"reason": "failed: %s; requeue 1/3"}\\n\' "$WHY"'])
    line = subprocess.run(["bash", "-c", sh], capture_output=True, text=True, check=True).stdout
    reason = json.loads(line)["reason"]
    assert reason == (f"failed: {read_failure(p.parent)['reason']} (trainer step ended first (trainer rc=1, "
                      f"rollout rc=143)); requeue 1/3")
    assert read_failure(p.parent)["reason"] == " ".join(NASTY.split())
    assert not (tmp_path / "pwned").exists() and read_user_error(p.parent) is None
