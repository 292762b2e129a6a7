"""The run directory and the file-backed rollout buffer.

With no Ray, the run directory on shared storage is the only state the two het groups
share and the only thing that survives a requeue. API:

Rollout driver (het group 1)::

    w = RolloutWriter(run)                       # run: RunDir or path
    rp = w.resume_point()                        # next id, data cursor, ids to regenerate
    w.commit(rp.next_rollout_id, samples, RolloutMeta(weight_versions=[v], data_cursor=cur))
    w.to_regenerate()                            # ids the trainer quarantined (poll between rollouts)

Trainer (het group 0)::

    r = RolloutReader(run)                       # rank 0; other ranks: readonly=True
    rollout = r.wait_for(progress.next_rollout_id, timeout=600, poll_interval=0.2, cancel=stop_event)
    progress.record_trained(rollout)             # TrainerProgress lives in the checkpoint
    after_checkpoint(r, progress, Retention(keep_trained=2))   # once the checkpoint is durable

    RolloutReader.replay(other_run)              # train from an existing buffer, no engine

Guarantees: a commit is all or nothing (manifest published last, exclusively); a torn or
corrupt rollout is detected by size + block checksums and never returned (rank 0
quarantines it, the driver regenerates it); each rollout is trained exactly once as far
as the checkpointed model is concerned. Errors name the file.

Control plane: `Control(run)` (engines, router, rendezvous, weight version and update, heartbeats,
preempt/stop), `read_ledger(run)`, `RunDir.mark_finished`. CLI: `rlslurm buffer ls|show|export`.
"""

from rlslurm.buffer.atomic import Cancelled, StorageError, fsync_dir, read_json, write_bytes_atomic, write_json_atomic
from rlslurm.buffer.export import export_jsonl, sample_to_json
from rlslurm.buffer.ledger import LedgerProblem, read_ledger
from rlslurm.buffer.manifest import CorruptRollout
from rlslurm.buffer.progress import Retention, TrainerProgress, after_checkpoint
from rlslurm.buffer.reader import BufferTimeout, ReadOnlyBuffer, RolloutReader
from rlslurm.buffer.rundir import RunDir
from rlslurm.buffer.sample import Rollout, RolloutMeta, RolloutStats, Sample, SampleStatus
from rlslurm.buffer.writer import AlreadyCommitted, CommitInfo, ResumePoint, RolloutWriter

# The control records use pydantic; import them on first use so that the data path
# (writer, reader, codec) needs only numpy - e.g. on a GPU image without pydantic.
_CONTROL = (
    "Control",
    "EngineRecord",
    "Heartbeat",
    "PreemptAck",
    "RendezvousRecord",
    "RendezvousTaken",
    "RouterRecord",
    "StopRequest",
    "WeightUpdateRecord",
    "WeightVersionRecord",
)


def __getattr__(name: str):
    if name in _CONTROL:
        from rlslurm.buffer import control

        return getattr(control, name)
    raise AttributeError(f"module 'rlslurm.buffer' has no attribute {name!r}")


__all__ = [
    "AlreadyCommitted",
    "BufferTimeout",
    "Cancelled",
    "CommitInfo",
    "Control",
    "CorruptRollout",
    "EngineRecord",
    "Heartbeat",
    "LedgerProblem",
    "PreemptAck",
    "ReadOnlyBuffer",
    "RendezvousRecord",
    "RendezvousTaken",
    "Retention",
    "ResumePoint",
    "Rollout",
    "RolloutMeta",
    "RolloutReader",
    "RolloutStats",
    "RolloutWriter",
    "RouterRecord",
    "RunDir",
    "Sample",
    "SampleStatus",
    "StopRequest",
    "StorageError",
    "TrainerProgress",
    "WeightUpdateRecord",
    "WeightVersionRecord",
    "after_checkpoint",
    "export_jsonl",
    "fsync_dir",
    "read_json",
    "read_ledger",
    "sample_to_json",
    "write_bytes_atomic",
    "write_json_atomic",
]
