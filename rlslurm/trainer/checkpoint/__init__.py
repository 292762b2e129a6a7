"""Trainer checkpoints (docs/checkpoints.md). One concern per module:

directory.py     the checkpoints directory: names, the completeness mark, verify, `latest`, prune
state.py         what a checkpoint holds (megatron `dist_checkpointing`), and loading it
resuming.py      the choice every rank resumes from, past a checkpoint that does not load
checkpointer.py  the saves: at most one in flight, complete and `latest` when every rank knows
writer.py        a rank's forked writer and rank 0's finalizer
staging.py       the host memory a save's copy is staged in
failures.py      what a failed save comes from (a full disk, the filesystem, anything else)
"""

from rlslurm.trainer.checkpoint.checkpointer import Checkpointer, Saved, save
from rlslurm.trainer.checkpoint.directory import (
    LATEST,
    META,
    PREFIX,
    checkpoint_bytes,
    ckpt_name,
    find_resume,
    prune,
    retention,
    verify,
    write_meta,
)
from rlslurm.trainer.checkpoint.resuming import resume
from rlslurm.trainer.checkpoint.state import load, load_model_weights, staging_estimate

__all__ = [
    "LATEST", "META", "PREFIX", "Checkpointer", "Saved", "checkpoint_bytes", "ckpt_name", "find_resume", "load",
    "load_model_weights", "prune", "resume", "retention", "save", "staging_estimate", "verify", "write_meta",
]
