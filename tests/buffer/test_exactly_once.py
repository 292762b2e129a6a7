"""Exactly-once: a scripted sequence of trainer crashes and restarts over 20 rollouts
trains each rollout id exactly once, checked from the trainer's own checkpoint.

The trainer keeps its "model" (the list of rollout ids applied to it) and its
TrainerProgress in one checkpoint file, like the real trainer keeps both in its
Megatron checkpoint. Retention keeps only 1 trained rollout, so a retention that
trusted anything but a durable checkpoint would delete a rollout a restarted trainer
still needs, and the restart would time out.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time

from rlslurm.buffer import (
    Retention,
    RolloutReader,
    RolloutWriter,
    RunDir,
    TrainerProgress,
    after_checkpoint,
    read_json,
    write_json_atomic,
)
from rlslurm.buffer.atomic import write_tmp

from .helpers import assert_same, make_meta, make_samples

N_ROLLOUTS = 20
SAVE_INTERVAL = 3
# (attempt, rollout id, where the trainer dies)
CRASHES = {
    (0, 4, "after_train"),  # trained 3 and 4 after the checkpoint of 2: both retrained
    (1, 8, "after_save"),  # checkpoint durable, trained.json/retention not yet updated
    (2, 9, "after_read"),  # read but not trained
    (3, 11, "mid_save"),  # checkpoint temp written, not renamed
    (4, 17, "after_train"),
}


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _trainer(run_path: str, attempt: int) -> None:
    run = RunDir(run_path)
    ckpt_path = run.checkpoints_dir / "ckpt.json"
    ckpt = read_json(ckpt_path)
    model = ckpt["model"] if ckpt else []
    progress = TrainerProgress.from_state_dict(ckpt["progress"]) if ckpt else TrainerProgress()
    reader = RolloutReader(run)
    with open(run.path / "train_events.log", "a") as log:
        while progress.next_rollout_id < N_ROLLOUTS:
            rid = progress.next_rollout_id
            rollout = reader.wait_for(rid, timeout=20, poll_interval=0.01)
            assert_same(rollout, make_samples(rid))
            if (attempt, rid, "after_read") in CRASHES:
                _die()
            model.append(rid)  # "training"
            progress.record_trained(rollout)
            log.write(f"{attempt} {rid}\n")
            log.flush()
            if (attempt, rid, "after_train") in CRASHES:
                _die()
            if (rid + 1) % SAVE_INTERVAL == 0 or rid == N_ROLLOUTS - 1:
                state = {"model": model, "progress": progress.state_dict()}
                if (attempt, rid, "mid_save") in CRASHES:
                    write_tmp(ckpt_path, [json.dumps(state).encode()])
                    _die()
                write_json_atomic(ckpt_path, state)
                if (attempt, rid, "after_save") in CRASHES:
                    _die()
                after_checkpoint(reader, progress, Retention(keep_trained=1))
    run.mark_finished({"attempt": attempt})


def _driver(run_path: str) -> None:
    w = RolloutWriter(run_path)
    rid = w.resume_point().next_rollout_id
    while rid < N_ROLLOUTS:
        w.commit(rid, make_samples(rid), make_meta(rid))
        rid += 1
        time.sleep(0.01)


def test_each_rollout_trained_exactly_once_across_crashes(run):
    # processes, not threads: forking a process that runs a thread can deadlock the child
    ctx = mp.get_context("fork")
    driver = ctx.Process(target=_driver, args=(str(run.path),))
    driver.start()
    attempt = 0
    try:
        while not run.is_finished():
            assert attempt <= len(CRASHES), "trainer did not finish after all scripted crashes"
            p = ctx.Process(target=_trainer, args=(str(run.path), attempt))
            p.start()
            p.join(60)
            assert p.exitcode in (0, -signal.SIGKILL), p.exitcode
            attempt += 1
    finally:
        driver.join(30)
        if driver.is_alive():
            driver.kill()
    assert driver.exitcode == 0

    assert attempt == len(CRASHES) + 1  # every scripted crash happened
    ckpt = read_json(run.checkpoints_dir / "ckpt.json")
    assert ckpt["model"] == list(range(N_ROLLOUTS))  # each id exactly once, in order
    progress = TrainerProgress.from_state_dict(ckpt["progress"])
    assert progress.last_trained_rollout_id == N_ROLLOUTS - 1 and progress.trained_rollouts == N_ROLLOUTS
    events = [tuple(map(int, line.split())) for line in (run.path / "train_events.log").read_text().splitlines()]
    retrained = [rid for rid in range(N_ROLLOUTS) if sum(1 for _, r in events if r == rid) > 1]
    assert {3, 4, 9, 10, 11, 15, 16, 17} <= set(retrained)  # the crashes really forced re-training
    assert RolloutReader(run).last_trained() == N_ROLLOUTS - 1
    assert RolloutReader(run).committed_ids() == [N_ROLLOUTS - 1]  # retention (keep 1) ran
