"""Attempt numbers across `rlslurm resubmit` and the failure budget's reset (issue 15 item 8), without
SLURM: the numbering, the ledger record, the batch script's own lines run by bash, `rlslurm status`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlslurm.buffer.attempts import failures_counted, next_attempt, record_resubmit
from rlslurm.buffer.ledger import read_ledger
from rlslurm.buffer.rundir import RunDir
from rlslurm.errors import ConfigError
from rlslurm.job.env import job_env
from rlslurm.resolve import resolve
from rlslurm.slurm.render import render
from rlslurm.slurm.status import run_status


def _script(attempt_base: int = 0) -> str:
    res = resolve(["--model", "tiny-qwen3", "--nodes", "2"], strict_inputs=False)
    return render(res.cfg, res.cfg.run_dir.resolve(), attempt_base=attempt_base)


def _line(script: str, var: str) -> str:
    [line] = re.findall(rf"^{var}=.*$", script, re.M)
    return line


def _attempt(rd: RunDir, n: int, reason: str, checkpoint: int = 0) -> None:
    """An attempt as the batch script leaves it: its log dir and its ledger line (the script's format)."""
    rd.attempt_log_dir(n).mkdir(parents=True)
    with open(rd.ledger, "a") as f:
        f.write(json.dumps({"attempt": n, "job_id": "7", "restart_count": n, "start": 1, "end": 2,
                            "exit_code": 1, "reason": reason, "trainer_nodes": "n1", "rollout_nodes": "n2",
                            "checkpoint": checkpoint}) + "\n")


FAILED = "failed: trainer step ended first (trainer rc=1, rollout rc=0); requeue 1/2"


def test_next_attempt_continues_after_dirs_and_ledger_lines(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path / "run")
    assert next_attempt(rd) == 0
    _attempt(rd, 0, FAILED)
    _attempt(rd, 1, "stopped by request")
    assert next_attempt(rd) == 2
    rd.attempt_log_dir(4).mkdir()  # started, killed before its ledger line
    assert next_attempt(rd) == 5
    record_resubmit(rd, 5, reset_failures=False)  # a record is not an attempt
    assert next_attempt(rd) == 5


def test_failure_budget_counts_since_the_last_reset_and_bash_agrees(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path / "run")
    awk = _line(_script(), "FAILURES")

    def bash_count() -> int:
        out = subprocess.run(["bash", "-c", f"{awk}\necho $FAILURES"], capture_output=True, text=True, check=True,
                             env={"LEDGER": str(rd.ledger), "PATH": os.environ["PATH"]})
        return int(out.stdout)

    assert bash_count() == failures_counted(read_ledger(rd)) == 0  # no ledger yet
    _attempt(rd, 0, FAILED)
    _attempt(rd, 1, "lost: no end record (node failure or hard kill)")
    _attempt(rd, 2, "requeue failed after 3 tries (scontrol: x); was: failed: y")
    _attempt(rd, 3, FAILED)
    assert bash_count() == failures_counted(read_ledger(rd)) == 2
    record_resubmit(rd, 4, reset_failures=False)  # the old count stands
    _attempt(rd, 4, FAILED)
    assert bash_count() == failures_counted(read_ledger(rd)) == 3
    record_resubmit(rd, 5, reset_failures=True)
    assert bash_count() == failures_counted(read_ledger(rd)) == 0
    _attempt(rd, 5, FAILED)
    assert bash_count() == failures_counted(read_ledger(rd)) == 1


def test_failure_budget_restarts_when_the_checkpoint_moves_on_and_bash_agrees(tmp_path: Path) -> None:
    """Fails before: every failure counted for the life of the run, so a long run ended at its fourth
    node failure however far it had come between them (bench/results/chaos.md, the budget finding)."""
    rd = RunDir.create(tmp_path / "run")
    script = _script()
    func = script[script.index("checkpoint_reached() {"):]
    func = func[:func.index("\n}\n") + 3]
    awk = _line(script, "FAILURES")

    def bash_count() -> int:
        """The script's count as it decides for the attempt that is ending (its line not written yet)."""
        out = subprocess.run(["bash", "-c", f"{func}\n{awk}\necho $FAILURES"], capture_output=True, text=True,
                             check=True, env={"LEDGER": str(rd.ledger), "RUN_DIR": str(rd.path),
                                              "PATH": os.environ["PATH"]})
        return int(out.stdout)

    counts = []
    for n, (reason, ckpt) in enumerate([(FAILED, 0), (FAILED, 4), ("preempted (USR1)", 8), (FAILED, 8),
                                        (FAILED, 8), (FAILED, 12), (FAILED, 12), (FAILED, 12)]):
        (rd.checkpoints_dir / "latest").write_text(json.dumps({"name": f"iter_{ckpt:07d}", "iteration": ckpt}))
        before = bash_count()  # the script decides, then writes the line
        _attempt(rd, n, reason, ckpt)
        after = failures_counted(read_ledger(rd))
        if reason == FAILED:  # the script's requeue n/M names the count the ledger then holds
            assert before + 1 == after, (n, before, after)
        counts.append(after)
    # each failure that left a newer checkpoint than any before it counts as the first of a new row
    assert counts == [1, 1, 0, 1, 2, 1, 2, 3]
    record_resubmit(rd, 8, reset_failures=True)
    assert bash_count() == failures_counted(read_ledger(rd)) == 0


def test_the_script_reads_the_checkpoint_as_python_does(tmp_path: Path) -> None:
    from rlslurm.attempt import checkpoint_reached

    rd = RunDir.create(tmp_path / "run")
    script = _script()
    func = script[script.index("checkpoint_reached() {"):]
    func = func[:func.index("\n}\n") + 3]

    def bash() -> int:
        out = subprocess.run(["bash", "-c", f"{func}\ncheckpoint_reached"], capture_output=True, text=True,
                             check=True, env={"RUN_DIR": str(rd.path), "PATH": os.environ["PATH"]})
        return int(out.stdout)

    assert bash() == checkpoint_reached(rd) == 0  # none yet
    for name, want in (("iter_0000000", 0), ("iter_0000040", 40), ("iter_0012345", 12345)):
        (rd.checkpoints_dir / "latest").write_text(json.dumps({"name": name, "iteration": want}))
        assert bash() == checkpoint_reached(rd) == want, name


def test_the_job_numbers_its_attempts_from_the_rendered_base() -> None:
    for base, restarts, want in ((0, None, 0), (0, 2, 2), (5, None, 5), (5, 3, 8)):
        line = _line(_script(base), "ATTEMPT")
        env = {} if restarts is None else {"SLURM_RESTART_COUNT": str(restarts)}
        out = subprocess.run(["bash", "-uc", f"{line}\necho $ATTEMPT"], env=env, capture_output=True, text=True,
                             check=True)
        assert int(out.stdout) == want, (line, env)
    assert 'export RLSLURM_ATTEMPT="$ATTEMPT"' in _script(5)
    with pytest.raises(ConfigError, match="attempt base"):
        _script(-1)


def test_processes_take_the_scripts_attempt_number() -> None:
    env = job_env({"SLURM_RESTART_COUNT": "1", "RLSLURM_ATTEMPT": "6", "SLURM_JOB_ID": "9"})
    assert (env.attempt, env.restart_count) == (6, 1)
    assert job_env({"SLURM_RESTART_COUNT": "2"}).attempt == 2  # a script from before the base
    assert job_env({}).attempt == 0


def test_status_shows_resubmits_apart_from_attempts(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path / "run")
    _attempt(rd, 0, FAILED)
    _attempt(rd, 1, FAILED + "; failure budget (1) exhausted")
    record_resubmit(rd, 2, reset_failures=True)
    rd.attempt_log_dir(2).mkdir()
    (rd.attempt_log_dir(2) / "attempt.json").write_text(json.dumps({"attempt": 2, "job_id": "8", "start": 3}))
    st = run_status(rd.path, query_slurm=False)
    assert [a["attempt"] for a in st.attempts] == [0, 1]
    assert st.current_attempt == {"attempt": 2, "job_id": "8", "start": 3}
    assert [(r["next_attempt"], r["reset_failures"]) for r in st.resubmits] == [(2, True)]


def test_status_says_why_a_finished_run_ended_early(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path / "run")
    assert run_status(rd.path, query_slurm=False).ended_early is None
    rd.mark_finished({"trained_rollouts": 3, "ended_early": "the prompt data ran out in rollout 3 of --num-rollout 4"})
    assert run_status(rd.path, query_slurm=False).ended_early.startswith("the prompt data ran out in rollout 3")
    p = subprocess.run([sys.executable, "-m", "rlslurm.cli", "status", str(rd.path)], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert p.returncode == 0, p.stderr
    assert "yes, early: the prompt data ran out in rollout 3" in " ".join(p.stdout.split())


@pytest.mark.parametrize("scontrol,alive", [
    ("JobId=7 JobState=COMPLETING Restarts=0\n", "COMPLETING"),
    ("JobId=7 HetJobOffset=0 JobState=COMPLETED Restarts=0\nJobId=8 HetJobOffset=1 JobState=COMPLETING Restarts=0\n",
     "COMPLETING"),
    ("JobId=7 JobState=COMPLETED Restarts=0\n", None)])
def test_a_job_still_ending_is_alive(monkeypatch, scontrol: str, alive: str | None) -> None:
    """COMPLETING: SLURM is still ending the job's processes, which may still write the run directory; a
    het job's component counts too. job_alive said None there."""
    from rlslurm.slurm import status

    monkeypatch.setattr(status, "_run", lambda cmd: scontrol if cmd[0] == "scontrol" else None)
    assert status.job_alive("7") == alive


def test_rlslurm_run_on_a_live_jobs_run_dir_is_refused_and_keeps_its_stop(tmp_path: Path, monkeypatch) -> None:
    """`rlslurm run RUN` on the run directory of a SLURM job that still runs (or ends) was accepted, and
    cleared that job's stop request on its way: refused like `rlslurm resubmit`, the stop kept."""
    from typer.testing import CliRunner

    from rlslurm import cli
    from rlslurm.buffer.control import Control
    from rlslurm.settings.flags import build_config
    from rlslurm.settings.runfile import dump_run_config
    from rlslurm.slurm import status

    rd = RunDir.create(tmp_path / "run")
    rd.run_yaml.write_text(dump_run_config(build_config([])))
    (rd.path / "jobs.json").write_text(json.dumps({"jobs": [{"job_id": "7", "submitted_at": 1}]}))
    Control(rd).request_stop("user request")
    monkeypatch.setattr(status, "_run", lambda cmd: "JobId=7 JobState=COMPLETING Restarts=0\n"
                        if cmd[0] == "scontrol" else None)
    r = CliRunner().invoke(cli.app, ["run", "--run-dir", str(rd.path)])
    assert r.exit_code != 0 and "its job 7 is still COMPLETING" in str(r.exception), r.output
    assert Control(rd).stop_requested() is not None


@pytest.mark.parametrize("damage", [b'{"jobs": [{"job_id": "7"', b'{"jobs": [{"job_id": 7}]}', b"[]"])
def test_a_damaged_jobs_record_is_never_final(tmp_path: Path, damage: bytes) -> None:
    """RUN/jobs.json names the run's current job: damaged on disk, status and cancel read no job (with a
    warning) and leave it where it is; it was a DataError (or a TypeError traceback) on every command."""
    from rlslurm.slurm.submit import current_job_id

    rd = RunDir.create(tmp_path / "run")
    (rd.path / "jobs.json").write_bytes(damage)
    assert current_job_id(rd.path) is None and run_status(rd.path).job_id is None
    assert (rd.path / "jobs.json").read_bytes() == damage
