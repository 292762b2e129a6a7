"""--debug-rollout-only's trainer step (rlslurm/trainer/rollout_only.py) on two gloo ranks in step
with rank 0: a preempt and a stop are acknowledged at once without a checkpoint (-1), and the run is
marked FINISHED only once every rollout id below --num-rollout is committed (a gap keeps it waiting).
The submit-time rules, and the driver's gate asking for version 0 (no trainer publishes)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest

from rlslurm.buffer.control import Control
from rlslurm.buffer.rundir import RunDir
from rlslurm.buffer.writer import RolloutWriter
from rlslurm.errors import ConfigError
from rlslurm.net import free_port
from rlslurm.resolve import resolve
from rlslurm.settings.config import RolloutSection, RunConfig, TrainSection
from tests.buffer.helpers import make_meta, make_samples
from tests.helpers.prompt_files import prompt_lines

NUM_ROLLOUT = 3


def _worker(rank: int, port: int, run: str, q) -> None:
    import torch.distributed as dist

    from rlslurm.trainer.rollout_only import watch

    # each rank the only one of its node (LOCAL_RANK 0), as on two trainer nodes: both keep a heartbeat
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        cfg = RunConfig(rollout=RolloutSection(num_rollout=NUM_ROLLOUT), train=TrainSection(debug_rollout_only=True))
        rd, control = RunDir(run), Control(RunDir(run))
        term = [False]
        out = {}
        for phase in ("preempt", "term", "stop", "finish"):
            if rank == 0:
                if phase == "preempt":  # what the batch shell writes on USR1
                    (rd.path / "control" / "preempt.json").write_text(json.dumps({"reason": "USR1"}))
                elif phase == "term":
                    assert control.preempt_ack().checkpoint_iteration == -1  # nothing saved
                    (rd.path / "control" / "preempt.json").unlink()
                    (rd.path / "control" / "preempt_ack.json").unlink()
                    term[0] = True  # SIGTERM to the trainer, as SLURM sends
                elif phase == "stop":
                    assert control.preempt_ack().checkpoint_iteration == -1
                    term[0] = False
                    (rd.path / "control" / "preempt_ack.json").unlink()
                    control.request_stop("test")
                else:
                    assert control.stop_ack().checkpoint_iteration == -1  # nothing saved
                    control.clear_stop()
                    w = RolloutWriter(rd)
                    for i in (0, 2):  # a gap at 1: not finished yet
                        w.commit(i, make_samples(i, n=4), make_meta(i))
                    q.put(("gap", None))
            t0 = time.monotonic()
            status = watch(cfg, rd, rank, lambda: term[0])
            out[phase] = (status, round(time.monotonic() - t0, 2))
        q.put((rank, out))
    finally:
        dist.destroy_process_group()


def test_the_watcher_acks_at_once_and_finishes_when_every_rollout_is_committed(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path / "run")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, str(rd.path), q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        assert q.get(timeout=120) == ("gap", None)
        time.sleep(3)  # three polls with rollout 1 missing
        assert not rd.is_finished(), "finished with rollout 1 not committed"
        RolloutWriter(rd).commit(1, make_samples(1, n=4), make_meta(1))
        results = dict(q.get(timeout=60) for _ in range(2))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    for rank in (0, 1):  # every phase ended on every rank with status 0
        assert sorted(results[rank]) == ["finish", "preempt", "stop", "term"], results
        assert all(status == 0 for status, _ in results[rank].values()), results
    assert results[0]["finish"][1] >= 3  # it waited for rollout 1
    info = rd.finished_info()
    assert info["trained_rollouts"] == 0 and info["generated_rollouts"] == NUM_ROLLOUT and info["debug_rollout_only"]
    assert sorted(p.name for p in (rd.path / "control" / "heartbeats").glob("trainer-*.json")) == \
        ["trainer-0.json", "trainer-1.json"]
    assert not (rd.path / "checkpoints").exists() or not any((rd.path / "checkpoints").iterdir())


def test_submit_refuses_what_it_cannot_do(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(prompt_lines())
    base = ["--model", "tiny-qwen3", "--prompt-data", str(prompts), "--run-dir", str(tmp_path / "run"),
            "--debug-rollout-only"]
    assert resolve(base, strict_inputs=False).cfg.train.debug_rollout_only
    with pytest.raises(ConfigError, match="--verify-weight-sync: --debug-rollout-only publishes no weights"):
        resolve(base + ["--verify-weight-sync"], strict_inputs=False)
    src = tmp_path / "src"
    RunDir.create(src)
    with pytest.raises(ConfigError, match="--debug-rollout-only .* and --load-debug-rollout-data .* exclude"):
        resolve(base + ["--load-debug-rollout-data", str(src)], strict_inputs=False)
