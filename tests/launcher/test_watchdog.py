"""The attempt's watchdog (rlslurm/watchdog.py) and its shell twin in the batch script agree on which
heartbeats are silent; the bound is validated against the collective timeout."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from rlslurm.errors import ConfigError
from rlslurm.resolve import resolve
from rlslurm.slurm.render import render
from rlslurm.watchdog import CHECK_EVERY_S, hang_timeout_s, silent_roles

BOUND = 600


def beat(hb: Path, name: str, age_s: float, now: float) -> None:
    hb.mkdir(parents=True, exist_ok=True)
    f = hb / f"{name}.json"
    f.write_text("{}")
    os.utime(f, (now - age_s, now - age_s))


CASES = [  # (heartbeats: name -> age in s, seconds since the attempt began, expected silent)
    ({"trainer-0": 5, "trainer-1": 5, "rollout-0": 5}, 3600, []),
    ({"trainer-0": 5, "trainer-1": BOUND + 60, "rollout-0": 5}, 3600, ["trainer-1"]),
    ({"trainer-0": 5, "rollout-0": BOUND + 1}, 3600, ["rollout-0"]),
    ({"rollout-0": 5}, 60, []),                     # the trainer is still starting: within the bound
    ({"rollout-0": 5}, BOUND + 30, ["trainer-0"]),  # it never beat since the attempt began
    ({}, BOUND + 30, ["rollout-0", "trainer-0"]),
]


@pytest.mark.parametrize("beats,since_s,silent", CASES)
def test_silent_roles(tmp_path: Path, beats: dict, since_s: float, silent: list[str]) -> None:
    now = time.time()
    for name, age in beats.items():
        beat(tmp_path / "heartbeats", name, age, now)
    assert silent_roles(tmp_path / "heartbeats", BOUND, now - since_s, now=now) == silent


def test_the_batch_script_finds_the_same_silent_roles(tmp_path: Path, prompts: Path) -> None:
    """The rendered script's own `silent_role` function, run by bash on the same files (it reports the
    first silent one; the Python side lists them all)."""
    cfg = resolve(["--model", "tiny-qwen3", "--prompt-data", str(prompts)], strict_inputs=False).cfg
    script = render(cfg, tmp_path / "run")
    fn = re.search(r"^silent_role\(\) \{\n.*?^\}\n", script, re.S | re.M)
    clock = re.search(r"^epoch\(\) \{.*\}\n", script, re.M)  # the clock it reads
    assert fn and clock, "the batch script has no silent_role or epoch function"
    for i, (beats, since_s, silent) in enumerate(CASES):
        control = tmp_path / f"c{i}"
        now = time.time()
        for name, age in beats.items():
            beat(control / "heartbeats", name, age, now)
        out = subprocess.run(["bash", "-c", clock.group(0) + fn.group(0) + "silent_role"], capture_output=True,
                             text=True, check=True,
                             env={"PATH": os.environ["PATH"], "CONTROL": str(control), "HANG_S": str(BOUND),
                                  "START_TS": str(int(now - since_s))}).stdout.strip()
        assert (out in silent) if silent else out == "", (beats, since_s, out)


@pytest.mark.skipif(shutil.which("strace") is None, reason="counts the script's metadata operations with strace")
def test_the_batch_scripts_check_costs_one_stat_per_heartbeat_file_a_minute(tmp_path: Path, prompts: Path) -> None:
    """At 128 nodes the check reads 128 heartbeat files: one stat(1) for them all and a listing, not a
    test and a stat(1) per file, and once a minute (CHECK_EVERY_S) against a bound of minutes
    (docs/shared-fs-load.md)."""
    cfg = resolve(["--model", "tiny-qwen3", "--prompt-data", str(prompts)], strict_inputs=False).cfg
    script = render(cfg, tmp_path / "run")
    assert CHECK_EVERY_S == 60 and "NEXT_HANG_CHECK=$(( NOW + 60 ))" in script
    fn = re.search(r"^silent_role\(\) \{\n.*?^\}\n", script, re.S | re.M)
    clock = re.search(r"^epoch\(\) \{.*\}\n", script, re.M)
    control, now = tmp_path / "control", time.time()
    names = [f"trainer-{i}" for i in range(8)] + [f"rollout-{i}" for i in range(8)]
    for name in names:
        beat(control / "heartbeats", name, 5, now)
    trace = tmp_path / "check.strace"
    subprocess.run(["strace", "-f", "-qq", "-y", "-o", str(trace), "-e", "trace=%file,getdents64",
                    "bash", "-c", clock.group(0) + fn.group(0) + "silent_role"], check=True,
                   env={"PATH": os.environ["PATH"], "CONTROL": str(control), "HANG_S": str(BOUND),
                        "START_TS": str(int(now))})
    ops = [ln for ln in trace.read_text().splitlines() if str(control) in ln and "execve" not in ln]
    # a listing is an open and two getdents; every file is stat(1)'s one statx (or newfstatat)
    assert len(ops) <= len(names) + 4, f"{len(ops)} ops:\n" + "\n".join(ops)


def test_bound_defaults_to_the_collective_timeout_plus_a_margin_and_renders(tmp_path: Path, prompts: Path) -> None:
    base = ["--model", "tiny-qwen3", "--prompt-data", str(prompts)]
    cfg = resolve(base + ["--distributed-timeout-minutes", "30"], strict_inputs=False).cfg
    assert hang_timeout_s(cfg.train) == 40 * 60
    assert "\nHANG_S=2400 " in render(cfg, tmp_path / "run")
    off = resolve(base + ["--hang-timeout-minutes", "0"], strict_inputs=False).cfg
    assert hang_timeout_s(off.train) == 0 and "\nHANG_S=0 " in render(off, tmp_path / "run")


def test_a_bound_within_the_collective_timeout_is_refused(prompts: Path) -> None:
    with pytest.raises(ConfigError) as e:
        resolve(["--model", "tiny-qwen3", "--prompt-data", str(prompts), "--distributed-timeout-minutes", "60",
                 "--hang-timeout-minutes", "45"], strict_inputs=False)
    msg = str(e.value)
    assert "\n" not in msg and "--hang-timeout-minutes 45" in msg and "--distributed-timeout-minutes 60" in msg
