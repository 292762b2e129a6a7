"""`rlslurm logs` shows what a run's logs say (issue 46): the 40-line tail of a finished demo's trainer
log was nanobind's leak report at exit, an engine's its HTTP access lines. The view leaves out and
counts those lines; `--raw` shows every line; the files on disk are untouched; `-f` follows the same way.

tests/launcher/demo_logs/ holds the ends of a real attempt's logs: `rlslurm run --demo --num-rollout 12`
on the CPU stack (torch 2.13, whose triton prints the nanobind report), the run directory's path
replaced by /home/user/runs/demo."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from rlslurm.buffer.rundir import RunDir
from rlslurm.log_view import follow, noise_kind, useful_tail

ROOT = Path(__file__).resolve().parents[2]
DEMO_LOGS = Path(__file__).parent / "demo_logs"
# an access line of a failed request: kept (invented; SGLang's format, the status made 500)
FAILED_REQUEST = '[2026-12-06 04:51:25] INFO:     127.0.0.1:33328 - "POST /generate HTTP/1.1" 500 Internal Server Error'


def run_with_logs(tmp_path: Path) -> RunDir:
    rd = RunDir.create(tmp_path / "run")
    logs = rd.attempt_log_dir(0)
    logs.mkdir(parents=True)
    for p in DEMO_LOGS.iterdir():
        shutil.copy(p, logs / p.name)
    with open(logs / "engine-0-0.log", "a") as f:
        f.write(FAILED_REQUEST + "\n")
    return rd


def logs(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rlslurm", "logs", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)


def test_the_tail_of_each_log_is_what_it_says(tmp_path: Path) -> None:
    rd = run_with_logs(tmp_path)
    before = {p.name: p.read_bytes() for p in rd.attempt_log_dir(0).iterdir()}
    p = logs(str(rd.path), "-n", "2")
    assert p.returncode == 0, p.stderr
    blocks = {b.split(" <==\n")[0].rsplit("/", 1)[1]: b.split(" <==\n")[1] for b in p.stdout.split("==> ")[1:]}
    assert list(blocks) == ["trainer-0.log", "rollout-0.log", "engine-0-0.log"]  # the roles first
    trainer = blocks["trainer-0.log"].splitlines()
    assert trainer[0].startswith("[trainer 1] ") and "saved checkpoint /home/user/runs/demo/" in trainer[0]
    assert trainer[1].startswith("[trainer 0] ") and "saved checkpoint" in trainer[1]
    assert trainer[2] == "(hid 61 lines: 61 nanobind leak report lines; --raw shows them)"
    engine = blocks["engine-0-0.log"].splitlines()
    assert engine[0].endswith("[continue_generation] torch.cuda.empty_cache() called: reserved 0.0 MB -> 0.0 MB "
                              "(freed 0.0 MB)")
    assert engine[1:] == [FAILED_REQUEST, "(hid 2 lines: 2 HTTP access lines (2xx/3xx); --raw shows them)"]
    assert "nanobind" not in p.stdout.replace("nanobind leak report lines", "")
    assert {p.name: p.read_bytes() for p in rd.attempt_log_dir(0).iterdir()} == before  # the logs stay whole
    raw = logs(str(rd.path), "-n", "2", "--raw").stdout
    assert "See https://nanobind.readthedocs.io/en/latest/refleaks.html" in raw and "(hid " not in raw


def test_noise_is_only_what_a_pattern_matches_whole() -> None:
    assert noise_kind("See https://nanobind.readthedocs.io/en/latest/refleaks.htmlnanobind: leaked 4 instances!")
    assert noise_kind('2026-11-27 10:08:21,577 httpx INFO HTTP Request: POST http://127.0.0.1:28671/generate '
                      '"HTTP/1.1 200 OK"') == "HTTP client lines (2xx/3xx)"
    assert noise_kind('[trainer 0] 2026-11-27 10:08:18,073 INFO HTTP Request: POST http://h:1/x "HTTP/1.1 503 '
                      'Service Unavailable"') is None
    assert noise_kind(FAILED_REQUEST) is None
    assert noise_kind("RuntimeError: nanobind: leaked") is None and noise_kind("") is None


def test_the_tail_reads_back_from_the_end(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    access = '[2026-12-06 04:51:24] INFO:     127.0.0.1:41000 - "POST /generate HTTP/1.1" 200 OK\n'
    log.write_text("first useful\n" + access * 5000 + "second useful\n" + access * 3)  # ~400 KB: several blocks
    t = useful_tail(log, 2)
    assert t.lines == ["first useful", "second useful"] and t.hidden == {"HTTP access lines (2xx/3xx)": 5003}


def test_follow_prints_new_useful_lines_and_logs_that_appear(tmp_path: Path) -> None:
    rd = run_with_logs(tmp_path)
    d = rd.attempt_log_dir(0)
    out, done = io.StringIO(), threading.Event()

    def write() -> None:
        time.sleep(0.3)
        with open(d / "trainer-0.log", "a") as f:
            f.write("nanobind: leaked 4 instances!\n[trainer 0] 2026-12-06 04:52:00,000 INFO rollout 12 step 24 | "
                    "reward 0.5\n")
        (d / "engine-0-1.log").write_text("[2026-12-06 04:52:01] server started\n")  # a restarted engine's
        time.sleep(0.5)
        done.set()

    t = threading.Thread(target=write)
    t.start()
    hidden = follow(lambda: sorted(d.glob("*.log")), out, poll_s=0.05, until=done.is_set)
    t.join()
    text = out.getvalue()
    assert f"==> {d / 'trainer-0.log'} <==\n[trainer 0] 2026-12-06 04:52:00,000 INFO rollout 12 step 24" in text
    assert f"==> {d / 'engine-0-1.log'} <==\n[2026-12-06 04:52:01] server started\n" in text
    assert "leaked" not in text and "saved checkpoint" not in text  # only what was appended
    assert hidden == {"nanobind leak report lines": 1}
