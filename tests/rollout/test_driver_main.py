"""`python -m rlslurm.rollout.main` in local mode (no SLURM env: node 0 of 1): one real CPU
SGLang server, the real router and the driver, from RUN/run.yaml to a committed rollout,
control files, heartbeats, and a clean exit on a stop request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlslurm.buffer.control import Control
from rlslurm.buffer.reader import RolloutReader
from rlslurm.buffer.rundir import RunDir
from rlslurm.config import DataSection, ModelSection, RolloutSection, RunConfig, RunSection, SlurmSection
from rlslurm.runfile import dump_run_config

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env["RLSLURM_ROLLOUT_HOST"] = "127.0.0.1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run_dir(tmp_path: Path, **model) -> RunDir:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"say {c}", "label": c}) + "\n" for c in "abcdef"))
    cfg = RunConfig(run=RunSection(device="cpu"), slurm=SlurmSection(gpus_per_node=0),
                    model=ModelSection(model="tiny-qwen3", **model),
                    data=DataSection(prompt_data=prompts),
                    rollout=RolloutSection(num_rollout=2, rollout_batch_size=2, n_samples_per_prompt=2,
                                           rollout_max_response_len=6, rm_type="exact", engines_per_node=1,
                                           sglang_dtype="float32", engine_health_interval_s=2.0),
                    sglang_args=["--max-total-tokens", "4096", "--mem-fraction-static", "0.3"])
    rd = RunDir.create(tmp_path / "run")
    rd.ensure_api_key()
    rd.run_yaml.write_text(dump_run_config(cfg))
    return rd


def _start(rd: RunDir) -> subprocess.Popen:
    log = open(rd.path / "rollout.log", "ab")
    return subprocess.Popen([sys.executable, "-m", "rlslurm.rollout.main", "--run-dir", str(rd.path),
                             "--trainer-addr", "127.0.0.1"], env=_env(), stdout=log, stderr=subprocess.STDOUT,
                            cwd=ROOT, start_new_session=True)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_without_a_checkpoint_no_engine_starts_and_stop_ends_it(tmp_path):
    rd = _run_dir(tmp_path)
    proc = _start(rd)
    try:
        deadline = time.monotonic() + 60
        while not Control(rd).heartbeats():  # it is alive and waiting
            assert proc.poll() is None and time.monotonic() < deadline, (rd.path / "rollout.log").read_text()
            time.sleep(0.2)
        assert (rd.path / "logs/attempt-0/env-rollout-0.json").exists()
        Control(rd).request_stop("test")
        assert proc.wait(timeout=60) == 0, (rd.path / "rollout.log").read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    assert Control(rd).engines() == [] and Control(rd).router() is None
    assert "rollout engines not started: no --hf-checkpoint" in (rd.path / "rollout.log").read_text()


@pytest.mark.sglang
@pytest.mark.slow
def test_local_rollout_node_commits_publishes_and_exits_on_stop(tmp_path, tiny_model):
    from rlslurm.rollout import sglang_cpu

    if sglang_cpu.installed_sglang_version() is None:
        pytest.skip("sglang is not installed")
    rd = _run_dir(tmp_path, hf_checkpoint=tiny_model)
    proc = _start(rd)
    reader = RolloutReader(rd)
    control = Control(rd)
    try:
        deadline = time.monotonic() + 400
        while not reader.is_committed(0):
            assert proc.poll() is None, (rd.path / "rollout.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (rd.path / "rollout.log").read_text()[-3000:]
            time.sleep(0.5)
        [engine] = control.engines()
        assert engine.healthy and engine.url.startswith("http://127.0.0.1:") and engine.restarts == 0
        router = control.router()
        assert router is not None and router.url.startswith("http://127.0.0.1:")
        assert any(hb.role == "rollout" and hb.rank == 0 for hb in control.heartbeats())
        assert len(reader.read(0).samples) == 4
        time.sleep(3)
        assert not reader.is_committed(1)  # sync mode: rollout 1 waits for weight version 1
        control.request_stop("test")
        assert proc.wait(timeout=60) == 0, (rd.path / "rollout.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    deadline = time.monotonic() + 10
    while _alive(engine.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(engine.pid), "the engine outlived the rollout node"
