"""Shared pieces of the trainer-loop tests: a tiny HF checkpoint, run directories with a
run.yaml, deterministic synthetic rollouts, torchrun launches with free ports, and a 1 MiB tmpfs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rlslurm.buffer import RolloutMeta, RolloutWriter, RunDir, Sample, SampleStatus
from rlslurm.net import free_port
from rlslurm.settings.config import RunConfig
from rlslurm.settings.runfile import dump_run_config
from tests.helpers.small_fs import small_fs  # noqa: F401  (registers the fixture here)

MODEL = "tiny-qwen3"
VOCAB = 64
HERE = Path(__file__).parent
REPO = HERE.parents[1]


def _pythonpath() -> str:
    """This checkout first, then whatever the caller's path holds (the GPU bundle's packages: docs/gpu.md)."""
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory) -> Path:
    from rlslurm.settings.model_config import load_model_config
    from rlslurm.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(load_model_config(MODEL), tmp_path_factory.mktemp("hf") / MODEL, seed=3)


def make_samples(rollout_id: int, n_groups: int = 2, per_group: int = 4, seed: int = 0,
                 with_logprobs: bool = True) -> list[Sample]:
    """A rollout's samples as the driver would commit them: content is a function of the ids."""
    rng = np.random.default_rng([rollout_id, seed])
    out = []
    for g in range(n_groups):
        prompt = rng.integers(4, VOCAB, int(rng.integers(2, 6)))
        for j in range(per_group):
            rl = int(rng.integers(2, 9))
            mask = np.ones(rl, dtype=np.uint8)
            if j == 1 and rl > 3:
                mask[1:3] = 0  # a tool span
            out.append(Sample(
                prompt_tokens=prompt, response_tokens=rng.integers(4, VOCAB, rl),
                reward=float(rng.integers(0, 2)) + 0.1 * j, loss_mask=mask,
                rollout_logprobs=(-rng.random(rl) * 3).astype(np.float32) if with_logprobs else None,
                status=SampleStatus.TRUNCATED if j == 3 else SampleStatus.COMPLETED,
                group_index=g, index=len(out), weight_version=rollout_id,
            ))
    return out


def commit_rollouts(run_dir: Path, ids: range, **kw: Any) -> None:
    w = RolloutWriter(run_dir)
    for rid in ids:
        w.commit(rid, make_samples(rid, **kw), RolloutMeta(weight_versions=[rid], data_cursor={"next": rid + 1}))


def make_run(path: Path, hf: Path | None, *, nproc: int = 1, train: dict | None = None,
             rollout: dict | None = None, megatron: dict | None = None) -> Path:
    RunDir.create(path)
    t = dict(micro_batch_size=2, global_batch_size=4, num_steps_per_rollout=2, lr=1e-3, bf16=False,
             use_distributed_optimizer=False, weight_sync="disk", clip_grad=1.0, adam_beta2=0.99)
    t.update(train or {})
    r = dict(num_rollout=2, rollout_batch_size=2, n_samples_per_prompt=4)
    r.update(rollout or {})
    cfg = RunConfig.model_validate({
        "run": {"run_name": "t", "run_dir": str(path), "device": "cpu", "seed": 7},
        "slurm": {"trainer_nodes": 1, "rollout_nodes": 1, "trainer_procs_per_node": nproc, "gpus_per_node": 0},
        "model": {"model": MODEL, "hf_checkpoint": str(hf) if hf else None},
        "rollout": r, "train": t, "megatron": megatron or {},
    })
    (path / "run.yaml").write_text(dump_run_config(cfg))
    return path


def torchrun(args: list[str], nproc: int, timeout: float = 180, **popen: Any) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": _pythonpath()}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO, **popen)


def bounded_torchrun(args: list[str], nproc: int, timeout: float) -> tuple[int, str]:
    """torchrun bounded by `timeout`: (returncode, output). A rank blocked in a collective never ends,
    and torchrun starts each worker in a session of its own: on a timeout every process of the tree is
    killed by pid and the test fails with the output."""
    import contextlib

    import psutil

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": _pythonpath()}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        out, _ = proc.communicate()
        pytest.fail(f"{nproc}-process run did not finish in {timeout:.0f} s (a rank waits in a collective?)\n"
                    f"{out[-4000:]}")
    return proc.returncode, out


# A step_worker run takes ~1 min on a loaded 2-core box; the bound is for a rank that waits forever.
STEP_RUN_BOUND_S = 150


@pytest.fixture(scope="session")
def step_results(request: pytest.FixtureRequest, tmp_path_factory) -> dict[str, dict[str, tuple[dict, Any]]]:
    """tests/trainer/step_worker.py for every module of this session that declares runs: one torchrun per
    world size for all of them (a torchrun start costs ~15 s of imports per process on 2 cores, and
    the runs are independent but for the process group they share), each run from a fresh megatron
    parallel state. A module declares its runs with a module-level function

        step_runs(request, tmp) -> [(key, nproc, run_dir, out_dir, resume_check[, resume_from]), ...]

    (`resume_check`: step_worker --resume-check for that run; `resume_from`: a checkpoints root
    that another run's --resume-check writes at a smaller world size, which runs first, loaded
    before this run's last step: step_worker --resume-from) and reads
    `step_results[module.__name__][key]`: the run's result.json and its exported weights. Only the
    modules of the tests selected in this session run theirs."""
    import torch

    modules = []
    for item in request.session.items:
        mod = getattr(item, "module", None)
        if mod is not None and callable(getattr(mod, "step_runs", None)) and mod not in modules:
            modules.append(mod)
    planned = [(mod.__name__, *run) for mod in modules
               for run in mod.step_runs(request, tmp_path_factory.mktemp(mod.__name__))]
    results: dict[str, dict[str, tuple[dict, Any]]] = {mod.__name__: {} for mod in modules}
    for nproc in sorted({p[2] for p in planned}):
        mine = [p for p in planned if p[2] == nproc]
        args = [str(HERE / "step_worker.py")]
        for _, _, _, run, out, resume, *frm in mine:
            args += ["--run-dir", str(run), "--out", str(out), *(["--resume-check", str(run)] if resume else []),
                     *(["--resume-from", str(run), str(frm[0])] if frm and frm[0] is not None else [])]
        rc, log = bounded_torchrun(args, nproc, timeout=300 + STEP_RUN_BOUND_S * len(mine))
        assert rc == 0, f"{nproc}-process step_worker runs {[f'{m}:{k}' for m, k, *_ in mine]}:\n{log[-6000:]}"
        for name, key, _, _, out, *_ in mine:
            results[name][key] = (json.loads((out / "result.json").read_text()), torch.load(out / "weights.pt"))
    return results


def run_trainer(run_dir: Path, nproc: int = 1, timeout: float = 180, check: bool = True) -> subprocess.CompletedProcess:
    p = torchrun(["-m", "rlslurm.trainer.main", "--run-dir", str(run_dir)], nproc, timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"trainer rc={p.returncode}\n--- stdout\n{p.stdout[-4000:]}"
                             f"\n--- stderr\n{p.stderr[-8000:]}")
    return p


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


def start_trainer(run: Path, log: Path) -> subprocess.Popen:
    """The trainer on 2 ranks under torchrun, in a session of its own, logging to `log`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "-m", "rlslurm.trainer.main", "--run-dir", str(run)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": _pythonpath()}
    with open(log, "w") as out:  # a file, not a pipe nobody drains (megatron is chatty)
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and its workers, like a node failure (torchrun starts each worker in a
    session of its own, so killing its process group is not enough)."""
    import psutil

    victims = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    psutil.wait_procs([psutil.Process(p) for p in victims[1:] if psutil.pid_exists(p)], timeout=30)


GRACE_S = 300  # --signal-grace-s (its default): what torchrun gives the TERM checkpoint

def start_attempt_trainer(run: Path, log: Path, env: dict[str, str]) -> subprocess.Popen:
    """The trainer of one node, 2 ranks, started as an attempt starts it (rlslurm/attempt.py)."""
    from rlslurm.attempt import trainer_argv

    cmd = trainer_argv(run, nnodes=1, node_rank=0, procs_per_node=2, master_addr="127.0.0.1",
                       master_port=free_port(), shutdown_timeout_s=GRACE_S)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": _pythonpath(), **env}
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

def wait_trained(run: Path, proc: subprocess.Popen, log: Path, steps: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not (run / "metrics.jsonl").exists() or len(metrics(run)) < steps:
        assert proc.poll() is None, log.read_text()[-6000:]
        assert time.monotonic() < deadline, f"{steps} steps not trained\n" + log.read_text()[-6000:]
        time.sleep(0.3)
