"""A rank-0 `Trainer` with no model and a real run directory, for tests of its poll (trainer/main.py
`_poll`: tests/trainer/test_trainer_republish.py, test_poll_cost.py)."""

from __future__ import annotations

from pathlib import Path

from rlslurm.buffer.control import Control, EngineRecord
from rlslurm.buffer.progress import TrainerProgress
from rlslurm.buffer.reader import RolloutReader
from rlslurm.buffer.rundir import RunDir
from rlslurm.settings.config import RunConfig, TrainSection
from rlslurm.trainer.main import Trainer

A, B = "http://10.0.0.1:30000", "http://10.0.0.2:30000"


def trainer(tmp_path: Path, *, weight_sync: str = "distributed", published: int | None = 3,
            trained: int = 3) -> Trainer:
    rd = RunDir.create(tmp_path / "run")
    t = Trainer(RunConfig(train=TrainSection(weight_sync=weight_sync)), rd, rank=0, world=1)
    t.reader = RolloutReader(rd)
    t.progress = TrainerProgress(next_rollout_id=trained, weight_version=trained, trained_rollouts=trained)
    t.delivery.published = published
    t.delivery.engines_up = True
    return t


def engines(control: Control, *, b_restarts: int = 1, b_awaiting: bool = True, b_healthy: bool = True) -> None:
    control.write_engines([EngineRecord(url=A, node="n0", healthy=True),
                           EngineRecord(url=B, node="n0", healthy=b_healthy, restarts=b_restarts,
                                        awaiting_weights=b_awaiting)])
