"""What the trainer loop (trainer/main.py) does around training one rollout, behind one interface
whether or not the engines share the trainer's GPUs, so that the loop does not fork on --colocate:

    turn.begin(rollout_id)       before training: the GPUs to the trainer
    turn.after_training(prog)    publish (if due) and checkpoint (if due); the phases' times
    turn.holding(params_only)    the trainer's tensors on the GPU for a while (a save, a publish)
    turn.release_for_save()      room for a full save outside the turn (a stop, a preempt, the run's end)
    turn.close()

`PlainTurn`: the trainer keeps its GPUs and the engines theirs. `ColocatedTurn` (--colocate): the two
take turns on the same GPUs (trainer/colocate.py `Colocation`), in an order that matters (below).
A turn calls back into the trainer for what stays the trainer's: its checkpoints (`save`,
`save_if_due`), when a publish is due (`publish_due`), whether the job ends (`ending_collective`);
the publishes go to its `delivery` (trainer/weights/delivery.py).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, ContextManager

from rlslurm.buffer.progress import TrainerProgress
from rlslurm.trainer import host_memory, offload_choice
from rlslurm.trainer.colocate import Colocation, EnginesGone, let_engines_start

log = logging.getLogger(__name__)


class PlainTurn:
    def __init__(self, trainer: Any):
        self.t = trainer

    def begin(self, rollout_id: int) -> None:
        pass  # the trainer holds its GPUs throughout

    def after_training(self, progress: TrainerProgress) -> dict[str, float]:
        t, t1 = self.t, time.perf_counter()
        if t.publish_due(progress):
            t.delivery.publish_or_defer(progress.weight_version)
        t2 = time.perf_counter()
        t.save_if_due(progress)
        return {"time/publish": t2 - t1, "time/save": time.perf_counter() - t2}

    def holding(self, *, params_only: bool = False) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def release_for_save(self) -> None:
        pass

    def close(self) -> None:
        pass


class ColocatedTurn:
    """--colocate. Built by `start` once the model is: the trainer's tensors that move leave the GPU, then
    the engines start (from the HF weights; a resumed version reaches them once they are up) and generate
    until the first rollout is committed."""

    def __init__(self, trainer: Any, colo: Colocation):
        self.t, self.colo = trainer, colo

    @classmethod
    def start(cls, trainer: Any) -> "ColocatedTurn":
        """The trainer decides which of its tensor sets move and moves them off the GPUs, then the
        engines may start: they size themselves on the memory free then (engines/memory_share.py), which
        leaves what the trainer keeps. A resumed version goes to them once they are up, from the loop's
        poll (WeightDelivery.due), like a publish again to a restarted engine."""
        t = trainer
        key = t.rd.api_key() if t.rd.api_key_file.exists() else None
        colo = Colocation(t.st, t.control, key, rank=t.rank, timeout_s=t.plan.timeout_s, ending=t.attempt_ending)
        # what moves: the user's flag, else what fits beside the engines (trainer/offload_choice.py)
        choice = offload_choice.for_run(t.cfg.run.offload_train, t.cfg, t.st, colo.sets, t.plan.bucket_bytes)
        colo.moves, colo.rest.keep = choice.moves, choice.keep_rest
        if t.rank == 0:
            log.info("colocate: %s", choice.describe())
        if colo.cuda:  # page-lock the host copies of what moves where the node has the memory (host_memory.py)
            budget, line = host_memory.copies_pin_budget(colo.copy_bytes(), t.host_locked, host_memory.local_ranks(),
                                                         t.host_room)
            colo.pin_within(budget)
            if line and t.rank == 0:
                log.warning("%s", line)
        colo.offload_all()
        margin = let_engines_start(t.st, t.control, attempt=t.attempt, rank=t.rank, bucket_bytes=t.plan.bucket_bytes,
                                   trains_beside=False, choice=choice, rest_on_gpu=colo.rest.device_nbytes)
        colo.watch_growth(choice.setting, margin, t.attempt)
        return cls(t, colo)

    def begin(self, rollout_id: int) -> None:
        """The engines give the GPUs to the trainer; `EnginesGone` if they went away meanwhile. Every
        engine up first: one still starting (a requeue trains buffered rollouts meanwhile) would hold
        its memory through the turn and miss its release."""
        self.t.delivery.wait_for_engines()
        self.colo.to_trainer(rollout_id + 1)

    def after_training(self, progress: TrainerProgress) -> dict[str, float]:
        """Save while everything is on the GPU; the engines then take it back, the weights first."""
        t, t1 = self.t, time.perf_counter()
        self.colo.finish_onload()  # a save reads the optimizer state (no step may have waited for it)
        if t.ending_collective():
            # the job ends inside the turn: its checkpoint is written now, while the trainer holds the
            # GPU and the engines are released; later (the engines resumed) it would onload the trainer
            # beside the engines' memory (docs/colocate.md, "When the job ends inside a turn")
            t.save(progress)
            raise EnginesGone("the job ends inside the turn: saved before the engines resume")
        t.save_if_due(progress)
        t2 = time.perf_counter()
        self.colo.to_engines_for_weights()
        t3 = time.perf_counter()
        published = t.publish_due(progress)
        if published:
            # no wait for every engine here: one that died in this turn is restarted only after it
            # (engines/turn_watch.py); it gets this version by the publish again once it is back
            t.delivery.publish(progress.weight_version, in_turn=True)
        t4 = time.perf_counter()
        self.colo.to_engines()
        if published and t.plan.verify and t.delivery.published == progress.weight_version:
            with self.holding(params_only=True):  # the engines generate again only now
                t.delivery.probe(progress.weight_version)
        return {"time/save": t2 - t1, "time/publish": t4 - t3, **self.colo.times}

    def holding(self, *, params_only: bool = False) -> ContextManager[Any]:
        return self.colo.holding(params_only=params_only)

    def release_for_save(self) -> None:
        self.colo.release_for_save()  # the save onloads the whole trainer: the engines give their memory up

    def close(self) -> None:
        self.colo.close()
