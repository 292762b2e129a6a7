"""Shared by the rollout tests (tests/rollout/test_driver.py, test_driver_main.py,
test_partial_rollout.py, conftest.py): prompt files, a driver on a deployment, its metrics, the
engines' weight-version label, and the rollout process started as the batch script starts it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from rlslurm.buffer.rundir import RunDir
from rlslurm.rollout.driver import RolloutDriver
from rlslurm.settings.config import DataSection, RolloutSection, RunConfig, TrainSection

WORDS = "abcdefghijklmnopqrstuvwxyz"
ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env["RLSLURM_ROLLOUT_HOST"] = "127.0.0.1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


async def set_version(dep, version: int) -> None:
    """Label every engine of deployment `dep` with weight version `version` (the weights stay)."""
    from rlslurm.engines.sglang_client import SGLangClient

    for url in dep.supervisor.urls:
        async with SGLangClient(url, dep.api_key) as c:
            await c.update_weight_version(str(version))


def write_prompts(path: Path, n: int, *, offset: int = 0) -> Path:
    lines = []
    for i in range(n):
        a, b = WORDS[(i + offset) % 26], WORDS[(3 * i + offset + 1) % 26]
        lines.append(json.dumps({"prompt": f"say {a} {b} answer :", "label": a}))
    path.write_text("\n".join(lines) + "\n")
    return path


def make_cfg(prompts: Path, **rollout) -> RunConfig:
    base = dict(num_rollout=1, rollout_batch_size=4, n_samples_per_prompt=4, rollout_max_response_len=8,
                rollout_temperature=1.0, rm_type="exact", rollout_max_concurrency=16)
    base.update(rollout)
    weight_sync = base.pop("weight_sync", "disk")
    eval_data = base.pop("eval_prompt_data", [])
    return RunConfig(data=DataSection(prompt_data=prompts, rollout_seed=7, eval_prompt_data=eval_data),
                     rollout=RolloutSection(**base), train=TrainSection(weight_sync=weight_sync))


def make_driver(dep, cfg: RunConfig, run: Path, **kw) -> RolloutDriver:
    from transformers import AutoTokenizer

    rd = RunDir.create(run)
    tok = AutoTokenizer.from_pretrained(str(dep.model_path))
    sup = dep.supervisor
    return RolloutDriver(cfg, rd, router_url=dep.router.url, engine_urls=lambda: sup.urls, api_key=dep.api_key,
                         tokenizer=tok, engine_restarts=lambda: sup.restarts_total, poll_s=0.05, **kw)


def metrics_lines(run: Path) -> list[dict]:
    p = run / "rollout_metrics.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def start_rollout_main(rd: RunDir) -> subprocess.Popen:
    """`python -m rlslurm.rollout.main` in local mode (no SLURM env) on `rd`, in a session of its own,
    appending to rd/rollout.log."""
    log = open(rd.path / "rollout.log", "ab")
    return subprocess.Popen([sys.executable, "-m", "rlslurm.rollout.main", "--run-dir", str(rd.path),
                             "--trainer-addr", "127.0.0.1"], env=_env(), stdout=log, stderr=subprocess.STDOUT,
                            cwd=ROOT, start_new_session=True)
