"""The api key never reaches an engine's or the router's log: the launcher's filter masks it in
everything the server tree writes, however the output is chunked, and logs are created 0600.
The real-server check (SGLang 0.5.23 prints `server_args={..., 'api_key': '<key>', ...}`) is in
test_engines.py on the shared deployment."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from rlslurm.buffer.atomic import open_log
from rlslurm.engines.engine import ENV_API_KEY
from rlslurm.engines.log_scrub import Scrubber

ROOT = Path(__file__).resolve().parents[2]
KEY = "-3c35ef26a4f47d29cd3f51eaae81e2fb842a96074eb930a7049a4346b8acc9ae"
# a line as SGLang 0.5.23 logs it at start (engine.py `_server_args_for_logging`), cut short
SERVER_ARGS_LINE = ("[2026-11-23 11:10:49] server_args={'model_path': '/run/hf_init', 'ssl_keyfile_password': None, "
                    "'enable_ssl_refresh': False, 'api_key': '%s', 'admin_api_key': None, 'served_model_name': "
                    "'/run/hf_init'}\n" % KEY)


@pytest.mark.parametrize("chunk", [1, 2, 7, 64, 65, 4096])
def test_the_key_is_masked_at_every_chunk_boundary(chunk: int) -> None:
    data = (SERVER_ARGS_LINE + "tail " + KEY[:10] + " then " + KEY + KEY + " end " + KEY[:-1]).encode()
    s = Scrubber(KEY.encode())
    out = b"".join(s.feed(data[i:i + chunk]) for i in range(0, len(data), chunk)) + s.flush()
    assert out == data.replace(KEY.encode(), b"***")
    assert b"'api_key': '***', 'admin_api_key': None" in out and KEY.encode() not in out


def test_only_a_possible_start_of_the_key_is_held_back() -> None:
    s = Scrubber(b"abcabd")
    assert s.feed(b"xx abcab") == b"xx "          # could still become the key
    assert s.feed(b"c") == b"abcabc"[:3]           # 'abcabc' is not the key; 'abc' may start it again
    assert s.feed(b"abd!") == b"***!" and s.flush() == b""


LEAKY = r'''
import logging, os, subprocess, sys
key = sys.argv[-1].split("=", 1)[1]
logging.basicConfig(format="%(message)s")
logging.getLogger("x").warning("server_args={'api_key': %r}", key)
print("argv", sys.argv, flush=True)
subprocess.run([sys.executable, "-c", "import os; os.write(1, os.environ['K'].encode())"], env={**os.environ, "K": key})
os.write(2, ("\nfd2 " + key + "\n").encode())
'''


def test_launcher_masks_the_key_in_the_whole_tree_and_logs_are_0600(tmp_path: Path) -> None:
    (tmp_path / "leaky_server.py").write_text(LEAKY)
    log = tmp_path / "logs" / "engine.log"
    old = os.umask(0o022)  # an ordinary umask, which would make the log 0644
    try:
        with open_log(log) as f:
            env = {**os.environ, ENV_API_KEY: KEY, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
            rc = subprocess.run([sys.executable, "-m", "rlslurm.engines.engine", "leaky_server", "--x"], env=env,
                                stdout=f, stderr=subprocess.STDOUT, cwd=tmp_path, timeout=60).returncode
    finally:
        os.umask(old)
    text = log.read_text()
    assert rc == 0, text
    assert KEY not in text
    # every writer went through the filter: the logger, print, a child process, a raw write to fd 2
    assert "server_args={'api_key': '***'}" in text and "'--api-key=***'" in text, text
    assert text.count("***") == 4, text
    assert stat.S_IMODE(log.stat().st_mode) == 0o600 and stat.S_IMODE(log.parent.stat().st_mode) == 0o700


def _lines(n: int) -> list[bytes]:
    return [(f"line {i:05d} " + ("key " + KEY if i % 7 == 0 else "x" * (i % 50)) + "\n").encode() for i in range(n)]


def test_the_filter_rotates_the_log_at_a_line_end(tmp_path: Path) -> None:
    from rlslurm.engines.log_scrub import copy_scrubbed

    lines = _lines(400)
    src = tmp_path / "server-output"
    src.write_bytes(b"".join(lines))
    log = tmp_path / "engine.log"
    with open(src, "rb") as fin, open_log(log) as fout:
        fout.write(b"==== an earlier start\n")
        fout.flush()
        copy_scrubbed(fin.fileno(), fout.fileno(), KEY.encode(), (str(log), 4000))
    old, new = Path(f"{log}.1").read_bytes(), log.read_bytes()
    longest = max(len(x) for x in lines)
    assert 4000 <= len(old) < 4000 + longest and len(new) < 4000 + longest
    assert old.endswith(b"\n") and new.endswith(b"\n")  # cut between lines, never inside one
    want = [x.replace(KEY.encode(), b"***") for x in lines]
    kept = (old + new).splitlines(keepends=True)
    assert kept == want[len(want) - len(kept):]  # the newest output, whole and in order
    assert stat.S_IMODE(log.stat().st_mode) == 0o600 and stat.S_IMODE(Path(f"{log}.1").stat().st_mode) == 0o600


SPAMMY = r'''
import sys
key = sys.argv[-1].split("=", 1)[1]
for i in range(300):
    print(f"request {i:04d} " + (key if i % 11 == 0 else "ok"), flush=True)
'''


def test_the_launcher_passes_the_log_bound_to_its_filter(tmp_path: Path) -> None:
    from rlslurm.engines.log_scrub import rotate_env

    (tmp_path / "spammy_server.py").write_text(SPAMMY)
    log = tmp_path / "logs" / "engine.log"
    with open_log(log) as f:
        env = {**os.environ, ENV_API_KEY: KEY, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}", **rotate_env(log, 2000)}
        rc = subprocess.run([sys.executable, "-m", "rlslurm.engines.engine", "spammy_server"], env=env,
                            stdout=f, stderr=subprocess.STDOUT, cwd=tmp_path, timeout=60).returncode
    assert rc == 0
    old, new = Path(f"{log}.1").read_text(), log.read_text()
    assert KEY not in old + new and len(old) < 2100 and len(new) < 2100
    assert new.splitlines()[-1] == "request 0299 ok" and old.endswith("\n")


def test_the_launcher_starts_the_router_without_importing_sglang(tmp_path: Path) -> None:
    """sglang-router's launcher imports its Python mini load balancer, and that SGLang's tracing, i.e. all
    of SGLang (torch, transformers: as many CPU seconds as an engine's start) for the Rust router: the
    launcher (rlslurm.engines.engine) keeps it out, and the router's launcher still runs."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONPROFILEIMPORTTIME": "1"}
    env.pop(ENV_API_KEY, None)
    p = subprocess.run([sys.executable, "-m", "rlslurm.engines.engine", "sglang_router.launch_router", "--help"],
                       env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "--worker-urls" in p.stdout, p.stderr[-3000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")}
    assert {"sglang_router.mini_lb", "sglang_router.router"} <= imported, sorted(imported)
    assert not imported & {"sglang", "torch", "transformers"}, sorted(imported)  # a submodule imports these first
