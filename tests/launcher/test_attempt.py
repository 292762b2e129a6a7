"""One attempt protocol for both runners (rlslurm/attempt.py): the rendered batch script's start, run by
bash up to where a FINISHED run or a stop request ends it (before any srun or scontrol), does what
`begin` does for `rlslurm run`; and the steps the script starts exec the commands `rlslurm run` starts.
Without SLURM: tests/slurm/test_slurm_job.py has the real jobs."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rlslurm import attempt
from rlslurm.buffer.rundir import RunDir
from rlslurm.local import LOCAL_ADDR, role_commands, run_local
from rlslurm.settings.config import RunConfig
from rlslurm.settings.runfile import dump_run_config
from rlslurm.slurm.launch import role_argv
from rlslurm.slurm.render import render

JOB = {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1", "SLURM_JOB_NODELIST_HET_GROUP_0": "t[1-2]",
       "SLURM_JOB_NODELIST_HET_GROUP_1": "r1"}
BASE = 2  # the job's attempt: BASE + SLURM_RESTART_COUNT = 3
STALE = ["preempt.json", "preempt_ack.json", "engines.json", "engines-node0.json", "engines-node12.json", "router.json",
         "weight_update.json", "rendezvous-0.json", "rendezvous-2.json", "heartbeats/trainer-0.json",
         "heartbeats/rollout-1.json"]
KEPT = ["api_key", "weight_version.json", "stop_ack.json", "secret_env", "heartbeats/.keep", "engines-old.txt"]


def _run_dir(path: Path, end_by: str) -> RunDir:
    """A run whose attempt 0 ended, attempt 1 was lost (its directory, no line), attempt 2 never
    started, with every kind of stale record and the records an attempt keeps."""
    rd = RunDir.create(path)
    rd.attempt_log_dir(0).mkdir()
    rd.attempt_log_dir(1).mkdir()
    before = attempt.Attempt(0, "70", 100, "t1", "r1")
    attempt.append_ledger(rd, before.ledger_record(200, 1, "failed: trainer step ended first"))
    for name in STALE + KEPT:
        f = rd.control_dir / name
        f.parent.mkdir(exist_ok=True)
        f.write_text("{}")
    (rd.control_dir / "stop.json" if end_by == "stop" else rd.finished).write_text('{"reason": "x"}')
    return rd


def _control_files(rd: RunDir) -> list[str]:
    return sorted(str(p.relative_to(rd.control_dir)) for p in rd.control_dir.rglob("*") if p.is_file())


def _untimed(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if k not in ("start", "end")}


@pytest.mark.parametrize("end_by, reason", [("finished", attempt.FINISHED), ("stop", attempt.STOPPED)])
def test_the_scripts_start_and_begin_clear_and_record_the_same(tmp_path: Path, end_by: str, reason: str) -> None:
    sh_rd, py_rd = _run_dir(tmp_path / "sh", end_by), _run_dir(tmp_path / "py", end_by)
    script = tmp_path / "job.sbatch"
    script.write_text(render(RunConfig(), sh_rd.path, attempt_base=BASE))
    subprocess.run(["bash", "-n", str(script)], check=True)
    p = subprocess.run(["bash", str(script)], cwd=sh_rd.path, env={"PATH": os.environ["PATH"], **JOB},
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr

    this = attempt.Attempt(BASE + 1, JOB["SLURM_JOB_ID"], 1000, JOB["SLURM_JOB_NODELIST_HET_GROUP_0"],
                           JOB["SLURM_JOB_NODELIST_HET_GROUP_1"])
    assert attempt.begin(py_rd, this) == reason
    attempt.end(py_rd, this, 0, reason)

    # exactly the stale records are gone, on both paths
    kept = sorted(KEPT + (["stop.json"] if end_by == "stop" else []))
    assert _control_files(sh_rd) == _control_files(py_rd) == kept
    # the same ledger: attempt 0's line (written by Python, recognised by the script), attempt 1 lost, the end
    sh_lines = sh_rd.ledger.read_text().splitlines()
    py_lines = py_rd.ledger.read_text().splitlines()
    assert [_untimed(json.loads(l)) for l in sh_lines] == [_untimed(json.loads(l)) for l in py_lines]
    assert [(r["attempt"], r["exit_code"], r["reason"]) for r in map(json.loads, py_lines)] == [
        (0, 1, "failed: trainer step ended first"), (1, attempt.LOST_EXIT_CODE, attempt.LOST), (3, 0, reason)]
    for sh, py in zip(sh_lines, py_lines):  # byte for byte but the times: printf writes what json.dumps writes
        assert re.sub(r'"(start|end)": \d+', "T", sh) == re.sub(r'"(start|end)": \d+', "T", py)
    lost_start = int(sh_rd.attempt_log_dir(1).stat().st_mtime)
    assert json.loads(sh_lines[1])["start"] == lost_start
    assert json.loads(py_lines[1])["start"] == int(py_rd.attempt_log_dir(1).stat().st_mtime)
    # the attempt's start record and its private log directory
    for rd in (sh_rd, py_rd):
        logs = rd.attempt_log_dir(BASE + 1)
        assert (logs.stat().st_mode & 0o777, (logs / "attempt.json").stat().st_mode & 0o777) == (0o700, 0o600)
        assert not rd.attempt_log_dir(BASE).exists()
    sh_start = (sh_rd.attempt_log_dir(BASE + 1) / "attempt.json").read_text()
    py_start = (py_rd.attempt_log_dir(BASE + 1) / "attempt.json").read_text()
    assert re.sub(r'"start": \d+', "T", sh_start) == re.sub(r'"start": \d+', "T", py_start)
    assert _untimed(json.loads(py_start)) == _untimed(this.start_record())


def test_begin_starts_an_attempt_when_nothing_ends_it(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path / "run")
    (rd.control_dir / "rendezvous-0.json").write_text("{}")
    this = attempt.Attempt(0, attempt.LOCAL, 5, attempt.LOCAL, attempt.LOCAL)
    assert attempt.begin(rd, this) is None
    assert _control_files(rd) == [] and not rd.ledger.exists()  # nothing lost, no end line yet
    assert json.loads((rd.attempt_log_dir(0) / "attempt.json").read_text()) == this.start_record()


def test_rlslurm_run_begins_with_the_same_start(tmp_path: Path) -> None:
    """`rlslurm run` on a FINISHED run: its start records the lost attempt and ends at once, as the job's."""
    rd = _run_dir(tmp_path / "run", "finished")
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}  # run_local sets its own
    try:
        res = run_local(rd.path, trainer_procs=1, num_rollout=1, progress=False)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert (res.returncode, res.reason, res.attempt) == (0, attempt.FINISHED, 2)
    assert _control_files(rd) == sorted(KEPT)
    lines = [json.loads(l) for l in rd.ledger.read_text().splitlines()]
    assert [(r["attempt"], r["job_id"], r["reason"]) for r in lines] == [
        (0, "70", "failed: trainer step ended first"), (1, attempt.LOCAL, attempt.LOST),
        (2, attempt.LOCAL, attempt.FINISHED)]


def _step_argv(script: str, role: str, port: int) -> list[str]:
    """The words of the role's step command, as bash expands them with the script's own values."""
    [cmd] = re.findall(rf'^\s*.*?("\$PYTHON" -m rlslurm\.slurm\.launch {role} .*) &$', script, re.M)
    assigns = [re.search(rf"^{v}=.*$", script, re.M)[0] for v in ("RUN_DIR", "PYTHON")]
    sh = "\n".join(assigns + [f"TRAINER_ADDR={LOCAL_ADDR} TRAINER_PORT={port}", f"printf '%s\\0' {cmd}"])
    out = subprocess.run(["bash", "-c", sh], capture_output=True, text=True, check=True).stdout
    return out.split("\0")[:-1]


def test_the_steps_and_rlslurm_run_start_the_same_commands(tmp_path: Path, monkeypatch) -> None:
    rd = RunDir.create(tmp_path / "run $(touch pwned) 'q'")
    cfg = RunConfig()
    cfg.slurm.trainer_procs_per_node = 3
    cfg.slurm.python = sys.executable  # as resolve sets it
    rd.run_yaml.write_text(dump_run_config(cfg))
    script = render(cfg, rd.path)
    local = role_commands(rd, cfg.trainer_procs_per_node, 15123)
    # one node of each group, as `rlslurm run` is: the same command, word for word
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_PROCID", "0")
    for role in ("trainer", "rollout"):
        step = _step_argv(script, role, 15123)
        assert step[:3] == [sys.executable, "-m", "rlslurm.slurm.launch"], step  # the script's $PYTHON
        assert step == attempt.step_argv(role, python=sys.executable, run_dir=str(rd.path), master_addr=LOCAL_ADDR,
                                         master_port="15123")
        assert role_argv(step[3:]) == local[role]
    assert not list(tmp_path.rglob("pwned"))
    # the second of two trainer nodes: only its place in the world differs
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_PROCID", "1")
    second = role_argv(_step_argv(script, "trainer", 15123)[3:])
    assert [w for w in second if w not in local["trainer"]] == ["--nnodes=2", "--node-rank=1"]


def test_printf_formats_write_what_json_dumps_writes() -> None:
    this = attempt.Attempt(4, "12", 3, "a[1-2]", "b")
    for fields, rec in ((attempt.LEDGER_FIELDS, this.ledger_record(9, -1, "x: y (z)")),
                        (attempt.START_FIELDS, this.start_record())):
        out = subprocess.run(["printf", attempt.printf_format(fields), *map(str, rec.values())],
                             capture_output=True, text=True, check=True).stdout
        assert out == json.dumps(rec) + "\n"
