"""--debug-rollout-only (slime's flag): the rollout group generates and commits every rollout; no
model is built and nothing is trained.

The trainer step still runs (the batch script and `rlslurm run` start the same two steps), but only
watches the run directory, every rank in step with rank 0's verdict:

- a preempt request (or SIGTERM) is acknowledged at once, with no checkpoint (-1): there is nothing
  to save, the buffer and the driver's committed cursor carry the progress over a requeue;
- a stop request is acknowledged the same way (the rollout group keeps its engines until then);
- once rollouts 0 .. num_rollout-1 are committed, or the driver recorded that the prompt data ran
  out (control/data_exhausted.json) and every rollout before that one is committed, the run is
  marked FINISHED.

Nothing retires rollouts (retention follows a trainer checkpoint), so every one stays in RUN/buffer
for inspection and for a later `--load-debug-rollout-data` replay. The driver's weight gate asks
for version 0 throughout (rollout/driver.py `required_version`): the engines keep the
--hf-checkpoint weights.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch.distributed as dist

from rlslurm.buffer.control import Control
from rlslurm.buffer.rundir import RunDir
from rlslurm.buffer.store import BufferStore
from rlslurm.heartbeat import Beat, keeps_heartbeat
from rlslurm.job.env import job_env
from rlslurm.settings.config import RunConfig
from rlslurm.trainer.collectives import from_rank0
from rlslurm.trainer.commands import POLL_S  # the trainer loop's cadence

log = logging.getLogger("rlslurm.trainer.rollout_only")


def _verdict(cfg: RunConfig, rd: RunDir, control: Control, term_received: Callable[[], bool],
             attempt: int) -> str | None:
    if control.preempt_requested() or term_received():
        return "preempt"
    if control.stop_requested():
        return "stop"
    committed = set(BufferStore(rd).committed_ids())
    if all(i in committed for i in range(cfg.rollout.num_rollout)):
        return "finished"
    exhausted = control.data_exhausted(attempt)
    if exhausted is not None and all(i in committed for i in range(exhausted.rollout_id)):
        return "exhausted"
    return None


def watch(cfg: RunConfig, rd: RunDir, rank: int, term_received: Callable[[], bool]) -> int:
    """Collective over the trainer ranks; returns the step's exit status (0)."""
    control = Control(rd)
    attempt = job_env().attempt
    log.info("--debug-rollout-only: no model is built; waiting for rollouts 0..%d to be committed",
             cfg.rollout.num_rollout - 1)
    # the watchdog's (rlslurm/watchdog.py)
    beat = Beat(lambda: control.heartbeat("trainer", rank), on=keeps_heartbeat(rank))
    while True:
        beat()
        verdict = from_rank0(rank, dist.get_world_size(),
                             lambda: _verdict(cfg, rd, control, term_received, attempt))
        if verdict is None:
            time.sleep(POLL_S)
            continue
        if rank == 0:
            if verdict == "preempt":
                control.ack_preempt(checkpoint_iteration=-1)
            elif verdict == "stop":
                control.ack_stop(checkpoint_iteration=-1)
            else:
                exhausted = control.data_exhausted(attempt) if verdict == "exhausted" else None
                ended = {} if exhausted is None else {"ended_early": exhausted.message}
                generated = cfg.rollout.num_rollout if exhausted is None else exhausted.rollout_id
                rd.mark_finished({"trained_rollouts": 0, "generated_rollouts": generated,
                                  "debug_rollout_only": True, "at": time.time(), **ended})
        log.info("--debug-rollout-only: %s", {"preempt": "preempt acknowledged (nothing to save)",
                                             "stop": "stop acknowledged (nothing to save)",
                                             "finished": "every rollout committed: run FINISHED",
                                             "exhausted": "the prompt data ran out: run FINISHED"}[verdict])
        return 0
