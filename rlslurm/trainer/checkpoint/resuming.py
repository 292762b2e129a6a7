"""Resuming a run: rank 0 chooses the newest intact checkpoint for every rank, every rank loads it,
and one that verifies but fails to load is passed over for the previous complete one
(docs/checkpoints.md, "When the filesystem fails")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from rlslurm.buffer.progress import TrainerProgress
from rlslurm.errors import UserError
from rlslurm.trainer.checkpoint.directory import find_resume, sweep_incomplete, warn
from rlslurm.trainer.checkpoint.state import load


def _choose(root: Path, failed: dict[Path, str]) -> Path | None:
    """Collective: rank 0's choice of a checkpoint to load, passing over those that `failed`."""
    choice = [None]
    if dist.get_rank() == 0:
        if not failed:
            sweep_incomplete(root)
        found = find_resume(root, frozenset(failed))
        choice = [str(found) if found is not None else None]
    dist.broadcast_object_list(choice, src=0)
    return None if choice[0] is None else Path(choice[0])


def _load_everywhere(st, d: Path) -> tuple[TrainerProgress | None, str | None]:
    """Collective: load `d` on every rank; this rank's progress, and the first rank's failure if any."""
    error: str | None = None
    progress = None
    try:
        progress = load(st, d)
    except UserError:
        raise  # the run's settings do not fit the checkpoint: an older one would not either
    except Exception as e:  # noqa: BLE001 - any failure of this checkpoint's load
        error = f"rank {dist.get_rank()}: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)  # every rank learns whether every rank loaded it
    return progress, next((e for e in errors if e), None)


def resume(st, root: Path) -> tuple[TrainerProgress, Path | None]:
    """Find the newest intact checkpoint (rank 0 decides for all) and load it. One that verifies but
    fails to load on any rank (a bit flip past the checksummed size, an I/O error while megatron reads
    it) is passed over with one warning for the previous complete one; when none loads, the attempt
    fails (never a silent start from scratch over trained progress)."""
    failed: dict[Path, str] = {}
    while True:
        d = _choose(root, failed)
        if d is None:
            if failed:
                raise RuntimeError(f"{root}: no checkpoint loads ("
                                   + "; ".join(f"{d.name}: {why}" for d, why in failed.items())
                                   + "); this attempt fails and is requeued (--max-failures)")
            return TrainerProgress(), None
        progress, failure = _load_everywhere(st, d)
        if failure is None:
            assert progress is not None
            return progress, d
        failed[d] = failure
        if dist.get_rank() == 0:
            warn(f"checkpoint {d} verifies but does not load ({failed[d]}); falling back to the previous "
                 f"complete one")
