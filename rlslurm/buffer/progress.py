"""Trainer progress: which rollouts are trained, stored *inside the trainer checkpoint*.

Exactly-once comes from keeping this record in the same checkpoint as the model: after
a crash the trainer resumes from checkpoint k with the progress of checkpoint k, so the
rollouts it trained after k are trained again on the model of k - for the surviving
model each rollout id is trained exactly once. Nothing the buffer itself writes can
disagree with the checkpoint, because the buffer's trained.json is only a hint written
*after* a checkpoint is durable (for retention and `buffer ls`).

Trainer loop:

    progress = TrainerProgress.from_state_dict(ckpt["rlslurm_progress"]) if ckpt else TrainerProgress()
    while ...:
        rollout = reader.wait_for(progress.next_rollout_id, ...)
        train(rollout)
        progress.record_trained(rollout)
        if save_now:
            save_checkpoint(..., rlslurm_progress=progress.state_dict())
            after_checkpoint(reader, progress, retention)   # trained.json + retention
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rlslurm.buffer.atomic import fsync_dir, unlink_durable, write_bytes_atomic, write_json_atomic
from rlslurm.buffer.export import export_jsonl
from rlslurm.buffer.manifest import CorruptRollout
from rlslurm.buffer.reader import ReadOnlyBuffer, RolloutReader
from rlslurm.buffer.sample import Rollout
from rlslurm.errors import ConfigError, DataError

STATE_VERSION = 1
log = logging.getLogger(__name__)


@dataclass
class TrainerProgress:
    next_rollout_id: int = 0
    last_trained_rollout_id: int | None = None
    weight_version: int = 0  # version of the weights after the last trained rollout
    trained_rollouts: int = 0  # count, a cheap cross-check against next_rollout_id

    def record_trained(self, rollout: Rollout | int, weight_version: int | None = None) -> None:
        rid = rollout if isinstance(rollout, int) else rollout.rollout_id
        if rid != self.next_rollout_id:
            raise DataError(
                f"rollout {rid}",
                f"trainer progress expected rollout {self.next_rollout_id} next; refusing to train out of order"
            )
        self.last_trained_rollout_id = rid
        self.next_rollout_id = rid + 1
        self.trained_rollouts += 1
        self.weight_version = self.weight_version + 1 if weight_version is None else weight_version

    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, **asdict(self)}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "TrainerProgress":
        if state.get("version") != STATE_VERSION:
            raise ConfigError(f"trainer progress state version {state.get('version')!r} is not {STATE_VERSION}")
        return cls(**{k: state[k] for k in cls.__dataclass_fields__})


@dataclass
class Retention:
    """Which committed rollouts stay in the buffer after a checkpoint. Kept: every untrained one;
    every one from `keep_from` on; at least the last `keep_trained` trained ones; and the newest
    committed one (its manifest holds the driver's data cursor). `export_dir`: write each retired
    rollout there as JSONL first.

    `keep_from` is the first rollout the OLDEST checkpoint still on disk trains after a resume
    (trainer/checkpoint/directory.py `retention`). The trainer falls back to an older checkpoint when the
    newest is corrupt, and then trains again every rollout after it - from the buffer, since the
    driver never regenerates a committed rollout; retiring one of those would end the run with
    "already trained and retired". None: only the checkpoint just taken counts."""

    keep_trained: int = 2
    export_dir: Path | None = None
    keep_from: int | None = None

    def __post_init__(self) -> None:
        if self.keep_trained < 0:
            raise ConfigError(f"buffer retention keep_trained must be >= 0, got {self.keep_trained}")
        if self.keep_from is not None and self.keep_from < 0:
            raise ConfigError(f"buffer retention keep_from must be >= 0, got {self.keep_from}")


def after_checkpoint(reader: RolloutReader, progress: TrainerProgress, retention: Retention | None = None) -> list[int]:
    """Call once the checkpoint holding `progress` is durable: record the trained mark
    and retire old trained rollouts. Returns the retired ids."""
    if reader.readonly:
        raise ReadOnlyBuffer(f"{reader.dir}: a replay buffer is not modified by training")
    if progress.last_trained_rollout_id is None:
        return []
    write_json_atomic(reader.trained_file,
                      {"last_trained_rollout_id": progress.last_trained_rollout_id, **progress.state_dict()})
    return retire(reader, progress.last_trained_rollout_id, retention or Retention())


def retire(reader: RolloutReader, last_trained: int, retention: Retention) -> list[int]:
    ids = reader.committed_ids()
    if not ids:
        return []
    cutoff = last_trained - retention.keep_trained  # ids <= cutoff go
    if retention.keep_from is not None:
        cutoff = min(cutoff, retention.keep_from - 1)
    doomed = [i for i in ids if i <= cutoff and i != ids[-1]]
    if doomed and retention.export_dir is not None:
        Path(retention.export_dir).mkdir(parents=True, exist_ok=True)
    for rid in doomed:
        if retention.export_dir is not None:
            out = Path(retention.export_dir) / f"{reader.kind}-{rid:08d}.jsonl"
            try:
                write_bytes_atomic(out, export_jsonl(reader.read(rid)))
            except (CorruptRollout, KeyError) as e:
                # already trained: a storage fault since then must not stop training
                log.error("not exporting rollout %d before retiring it: %s", rid, e)
        try:
            m = reader.manifest(rid)
        except CorruptRollout:
            m = None  # the manifest goes anyway; its unreferenced data is swept by cleanup()
        # manifest first: the rollout stops being committed before its data goes
        if not unlink_durable(reader.manifest_path(rid)) or m is None:
            continue
        try:
            os.unlink(reader.dir / m.data_file)
        except FileNotFoundError:
            pass
    if doomed:
        fsync_dir(reader.dir)
    return doomed


