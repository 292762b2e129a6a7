"""This trainer's saves: at most one in flight, staged in the trainer's stall, written in the
background, complete and `latest` when every rank learns so at the same call (docs/checkpoints.md,
"Asynchronous saves"). The writer's mechanism is writer.py's; the directory's rules directory.py's;
what is saved state.py's."""

from __future__ import annotations

import errno
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlslurm.buffer.atomic import StorageError, human_size, retry_transient, storage_full
from rlslurm.buffer.progress import TrainerProgress
from rlslurm.trainer.checkpoint import staging, writer
from rlslurm.trainer.checkpoint.directory import (
    checkpoint_bytes,
    ckpt_name,
    find_complete,
    fresh_dir,
    point_latest,
    prune,
    verify,
    warn,
    write_meta,
)
from rlslurm.trainer.checkpoint.failures import is_no_space, is_storage_failure, nearly_full
from rlslurm.trainer.checkpoint.state import optimizers_with_state, sharded_state, staging_estimate

log = logging.getLogger(__name__)


@dataclass
class Saved:
    """A checkpoint that is complete, verified and `latest`."""

    path: Path
    progress: TrainerProgress  # what it holds (the trainer has moved on since, when it was asynchronous)
    stall_s: float             # the trainer's stop to stage it
    total_s: float             # start to `latest` (rank 0's finalizer moved it)
    staging: str = "none"      # where this rank's copy went: "pinned", "pageable" (staging.py)
    stage_s: float = 0.0       # the copy's part of the stall


@dataclass
class _InFlight:
    path: Path
    progress: TrainerProgress
    write: writer.RankWrite
    finalizer: writer.Finalizer | None  # rank 0's, else None
    t0: float
    stall_s: float


class Checkpointer:
    """This trainer's checkpoints: at most one save in flight (docs/checkpoints.md, "Asynchronous
    saves"). Every method is collective (every rank calls it at the same point).

    `start` stages a copy of the state and returns: forked writers write it, rank 0's finalizer
    completes it and moves `latest` (trainer/checkpoint/writer.py), while the trainer trains or waits
    for rollouts. `poll` (non-blocking) and `wait` (blocking: before a preempt/stop ack, the end of the
    run, the next save) report a finished save to every rank alike; a failed one raises on every
    rank. `asynchronous=False` waits inside `start`."""

    def __init__(self, root: Path, keep: int, *, asynchronous: bool = True):
        self.root, self.keep, self.asynchronous = root, keep, asynchronous
        self.in_flight: _InFlight | None = None

    @staticmethod
    def prepare(st, *, pin: bool = True) -> None:
        """Reserve the staging area in the background on a GPU trainer (trainer/checkpoint/staging.py),
        so that the first save does not page-lock it inside its stall. `pin` False: the node has too
        little host memory to page-lock it (trainer/host_memory.py): every save stages in pageable
        memory. Not collective."""
        if not torch.cuda.is_available() or next(st.actor.inner.parameters()).device.type != "cuda":
            return
        nbytes = staging_estimate(st)
        log.info("reserving %.1f GiB of %s host memory for checkpoint staging in the background", nbytes / 2**30,
                 "page-locked" if pin else "pageable")
        staging.area().allow_pin = pin
        staging.area().reserve(nbytes, pin=pin)

    @property
    def pending_iteration(self) -> int | None:
        return None if self.in_flight is None else self.in_flight.progress.trained_rollouts

    def start(self, st, progress: TrainerProgress) -> Saved | None:
        """Stage and hand off the checkpoint of `progress`. Returns a save this had to wait for
        first (or, synchronous, this one)."""
        before = self.wait() if self.in_flight is not None else None
        t0 = time.perf_counter()
        writer.in_process_write_results()
        rank, world = dist.get_rank(), dist.get_world_size()
        snapshot = TrainerProgress.from_state_dict(progress.state_dict())
        d = self.root / ckpt_name(snapshot.trained_rollouts)
        write, kept, optimizers = self._stage(st, snapshot, d)
        finalizer = None
        if rank == 0:
            finalizer = writer.Finalizer(d, world, kept,
                                         lambda: self._complete(d, snapshot, world, sorted(optimizers)))
            finalizer.start()
        stall = time.perf_counter() - t0
        self.in_flight = _InFlight(d, snapshot, write, finalizer, t0, stall)
        log.info("checkpoint %s staged in %.2f s (the copy %.2f s, %s); writing in the background", d.name,
                 stall, write.stage_s, write.staging)
        if not self.asynchronous:
            return self.wait()
        return before

    def _stage(self, st, snapshot: TrainerProgress, d: Path) -> tuple[writer.RankWrite, Any, set[str]]:
        """Collective: a fresh `d`, megatron's plan of the save (and rank 0's common.pt), this rank's
        staged copy and its forked writer. Returns the writer, what the finalizer needs of megatron's
        plan, and the optimizers saved. A full disk is one line (`_no_space`)."""
        from megatron.core import dist_checkpointing

        rank = dist.get_rank()
        try:
            if rank == 0:
                fresh_dir(self.root, d)
            dist.barrier()
            optimizers = optimizers_with_state(st)
            strategy = writer.keeping_strategy()
            request = dist_checkpointing.save(
                sharded_state(st, snapshot, loading=False, with_rng=True, optimizers=optimizers), str(d),
                sharded_strategy=strategy, async_sharded_save=True, **writer.mcore_async_strategy())
            return writer.RankWrite(d, rank, request), strategy.kept, optimizers
        except (OSError, RuntimeError) as e:  # rank 0's common.pt: the other ranks meet a dead peer at the next
            # collective. torch.save's zip writer reports a full disk as a RuntimeError ("basic_ios::clear:
            # iostream error", "unexpected pos 64 vs 0"), without the errno: the filesystem then says it.
            if not (is_no_space(e) or (isinstance(e, RuntimeError) and nearly_full(d))):
                raise
            if rank == 0:
                shutil.rmtree(d, ignore_errors=True)
            raise self._no_space(d, e) from e

    def _complete(self, d: Path, progress: TrainerProgress, world: int, optimizers: list[str]) -> None:
        """Rank 0, the finalizer's last step: the completeness mark, a check of every file against
        it, and only then `latest`."""
        write_meta(d, progress.trained_rollouts, world, {"progress": progress.state_dict(), "optimizers": optimizers})
        if (problem := verify(d)) is not None:  # the filesystem's doing: the attempt fails, nothing is final
            raise StorageError(f"{d}: the checkpoint just written does not verify: {problem}; `latest` still "
                               f"names the last complete one")
        point_latest(self.root, d, progress.trained_rollouts)
        try:
            retry_transient(lambda: prune(self.root, self.keep), self.root, "removing old checkpoints")
        except (OSError, StorageError) as e:  # this checkpoint is complete and `latest`: the next save prunes
            warn(f"removing old checkpoints in {self.root} failed ({e}); the next save tries again")

    def poll(self) -> Saved | None:
        """The in-flight save if it has finished (then every rank knows), else None."""
        if self.in_flight is None:
            return None
        return self._settle(block=False)

    def wait(self) -> Saved | None:
        """Block until the in-flight save is `latest` (or has failed: raised on every rank)."""
        if self.in_flight is None:
            return None
        return self._settle(block=True)

    def _settle(self, *, block: bool) -> Saved | None:
        """Every rank's writer outcome to every rank, then rank 0's finalizer's: all ranks reach the
        same verdict at the same call. A failed writer stops the finalizer, which would wait for its
        results forever."""
        f = self.in_flight
        assert f is not None
        mine = f.write.status(block=block)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        failures = {r: o[1] for r, o in enumerate(everyone) if o is not None and o[0] != "ok"}
        if not failures and any(o is None for o in everyone):
            return None  # still writing
        verdict: list[Any] = [None]
        if f.finalizer is not None:
            if failures:
                f.finalizer.stop()
            if block or failures:
                f.finalizer.join()
            if failures:
                verdict = [("error", failures, None)]
            elif (out := f.finalizer.outcome) is not None:
                verdict = [(*out, f.finalizer.t_done - f.t0)]
        dist.broadcast_object_list(verdict, src=0)
        return None if verdict[0] is None else self._finish(verdict[0])

    def _finish(self, outcome: tuple[str, Any, float | None]) -> Saved:
        f, self.in_flight = self.in_flight, None
        assert f is not None
        status, error, latest_after = outcome
        if status != "ok":
            f.write.kill()  # another rank's failure may end this save while this rank still writes
            # torch's zip writer reports a short write without its errno ("unexpected pos"): ask the disk
            full = is_no_space(error) or nearly_full(f.path)
            if dist.get_rank() == 0:
                shutil.rmtree(f.path, ignore_errors=True)  # never pointed to; on a full disk, the space
            if full:
                raise self._no_space(f.path, error)
            what = ("; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in sorted(error.items()))
                    if isinstance(error, dict) else f"{type(error).__name__}: {error}")
            # the filesystem failing (EIO that outlasted its retries, a file that does not verify): one
            # line and a failed attempt (docs/shared-filesystem.md), not a traceback
            kind = StorageError if is_storage_failure(error) else RuntimeError
            raise kind(f"checkpoint {f.path}: the save failed ({what}); `latest` still names the last complete one")
        log.info("checkpoint %s complete and latest %.2f s after its start (stall %.2f s)", f.path.name,
                 latest_after, f.stall_s)
        return Saved(f.path, f.progress, f.stall_s, latest_after, f.write.staging, f.write.stage_s)

    def _no_space(self, d: Path, error: BaseException | str | None) -> StorageError:
        """One line: the full filesystem, what a checkpoint of this run takes, the last one intact."""
        last = find_complete(self.root)
        needs = (f"a checkpoint of this run takes {human_size(checkpoint_bytes(last))} ({last.name}), which is intact"
                 if last is not None else "this is the run's first checkpoint")
        return storage_full(d, errno.ENOSPC, f"saving checkpoint {d.name}", needs)

    def abort(self) -> None:
        """Drop the in-flight save (the process is going anyway): its writer is killed."""
        if self.in_flight is not None:
            self.in_flight.write.kill()
            if self.in_flight.finalizer is not None:
                self.in_flight.finalizer.stop()
            self.in_flight = None


def save(st, progress: TrainerProgress, root: Path, keep: int) -> Path:
    """Collective: one synchronous save (staged, written, complete and `latest` on return)."""
    saved = Checkpointer(root, keep, asynchronous=False).start(st, progress)
    assert saved is not None
    return saved.path
