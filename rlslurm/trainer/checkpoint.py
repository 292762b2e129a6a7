"""Trainer checkpoints: megatron `dist_checkpointing`, an atomic `latest` pointer, keep-last-K,
and a fallback to the previous checkpoint when the latest one is corrupt or incomplete.

Layout (RUN/checkpoints/):

    iter_0000004/            one checkpoint; 4 = rollouts trained when it was taken
      *.distcp, common.pt, .metadata, metadata.json    written by dist_checkpointing (all ranks)
      rlslurm.json           written LAST by rank 0: sizes (+crc32) of every file, world size
    latest                   {"name": "iter_0000004", "iteration": 4}, replaced by rename

A checkpoint without `rlslurm.json`, or whose files do not match it, is incomplete: it is never
pointed to, and on load it is skipped with a loud warning (the previous complete one is used).
What a checkpoint holds: actor model + optimizer (+ critic), LR schedules, every rank's RNG
states, and the TrainerProgress (last trained rollout id, weight version): exactly-once training
comes from keeping the progress in the same checkpoint as the weights (buffer/progress.py).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import queue
import random
import shutil
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rlslurm.buffer.atomic import (
    NO_SPACE_ERRNOS,
    TRANSIENT_ERRNOS,
    StorageError,
    StorageFull,
    TransientStorageError,
    fsync_dir,
    human_size,
    listdir_fresh,
    retry_transient,
    storage_full,
    write_json_atomic,
)
from rlslurm.buffer.progress import Retention, TrainerProgress
from rlslurm.errors import DataError
from rlslurm.trainer.collectives import collective_device

log = logging.getLogger(__name__)

PREFIX = "iter_"
META = "rlslurm.json"
LATEST = "latest"
FORMAT = 1
CRC_MAX_BYTES = 256 * 1024**2  # bigger files are checked by size only (a full read costs minutes)


def ckpt_name(iteration: int) -> str:
    return f"{PREFIX}{iteration:07d}"


def _crc32(path: Path) -> int:
    """The file's crc32; a transient error (EIO, ESTALE, EAGAIN) restarts the read (buffer/atomic.py
    `retry_transient`), one that persists is a TransientStorageError."""
    def once() -> int:
        crc = 0
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                crc = zlib.crc32(chunk, crc)
        return crc

    return retry_transient(once, path, "reading it for its checksum")


def _files(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file() and p.name != META)


def write_meta(d: Path, iteration: int, world: int, extra: dict[str, Any]) -> None:
    """Fsync every file, record sizes/checksums, then publish META (the completeness mark). Every step
    only reads or rewrites whole, so a transient error repeats it (`retry_transient`)."""
    def once() -> dict[str, Any]:
        files = {}
        for p in _files(d):
            with open(p, "rb") as f:
                os.fsync(f.fileno())
            size = p.stat().st_size
            files[str(p.relative_to(d))] = {"size": size, "crc32": _crc32(p) if size <= CRC_MAX_BYTES else None}
        for sub in {p.parent for p in _files(d)} | {d}:
            fsync_dir(sub)
        return files

    files = retry_transient(once, d, "syncing and summing the checkpoint's files")
    write_json_atomic(d / META, {"format": FORMAT, "iteration": iteration, "world_size": world, "files": files, **extra})


def verify(d: Path) -> str | None:
    """None if checkpoint `d` is complete and intact, else what is wrong with it. Its reads are
    retried on a transient error; one that persists, or any other refusal, makes it unusable (its
    caller falls back to an older checkpoint, or fails the save)."""
    try:
        return retry_transient(lambda: _verify(d), d, "verifying the checkpoint")
    except (OSError, StorageError) as e:
        return f"{d} cannot be read: {e.strerror if isinstance(e, OSError) and e.strerror else e}"


def _verify(d: Path) -> str | None:
    meta_path = d / META
    if not meta_path.exists():
        return f"{meta_path} is missing (checkpoint incomplete)"
    try:
        meta = json.loads(meta_path.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        return f"{meta_path} is unreadable: {e}"
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        return f"{meta_path}: format {meta.get('format') if isinstance(meta, dict) else meta!r} is not {FORMAT}"
    files = meta.get("files", {})
    if not isinstance(files, dict):
        return f"{meta_path}: its file list is damaged"
    for rel, info in files.items():
        p = d / rel
        if not isinstance(info, dict) or not isinstance(info.get("size"), int):
            return f"{meta_path}: the entry of {rel} is damaged"
        if not p.is_file():
            return f"{p} is missing"
        if p.stat().st_size != info["size"]:
            return f"{p} has {p.stat().st_size} bytes, expected {info['size']}"
        if info.get("crc32") is not None and _crc32(p) != info["crc32"]:
            return f"{p}: checksum mismatch"
    return None


def _iteration_of(name: str) -> int | None:
    if not name.startswith(PREFIX):
        return None
    try:
        return int(name[len(PREFIX):])
    except ValueError:
        return None


def candidates(root: Path) -> list[Path]:
    """Checkpoints to try, best first: the one `latest` points to, then the others, newest first."""
    names = listdir_fresh(root)  # a transient error retried; absent: []
    found = sorted((root / n for n in names if _iteration_of(n) is not None and (root / n).is_dir()),
                   key=lambda p: _iteration_of(p.name), reverse=True)
    latest = read_latest(root)
    if latest is not None and (root / latest) in found:
        found.remove(root / latest)
        found.insert(0, root / latest)
    return found


def read_latest(root: Path) -> str | None:
    try:
        obj = json.loads((root / LATEST).read_text())
        return str(obj["name"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        _warn(f"{root / LATEST} is unreadable ({e}); looking for the newest complete checkpoint instead")
        return None


def _warn(msg: str) -> None:
    log.warning(msg)
    print(f"rlslurm trainer: WARNING: {msg}", file=sys.stderr, flush=True)


def find_resume(root: Path, skip: frozenset[Path] = frozenset()) -> Path | None:
    """The newest intact checkpoint, warning loudly about every one passed over (`skip`: ones that
    verified but failed to load)."""
    latest = read_latest(root)
    for i, d in enumerate(candidates(root)):
        if d in skip:
            continue
        problem = verify(d)
        if problem is None:
            if i > 0 or (latest is not None and d.name != latest):
                _warn(f"falling back to checkpoint {d} (the latest one is unusable)")
            return d
        _warn(f"checkpoint {d} is unusable: {problem}")
    return None


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints (and incomplete older ones). The
    META goes first so that a half-deleted directory can never look complete."""
    latest = read_latest(root)
    dirs = sorted((p for p in root.iterdir() if p.is_dir() and _iteration_of(p.name) is not None),
                  key=lambda p: _iteration_of(p.name), reverse=True)
    complete = [d for d in dirs if (d / META).exists()]
    keep_set = set(complete[:keep]) | ({root / latest} if latest else set())
    newest_complete = _iteration_of(complete[0].name) if complete else -1
    doomed = [d for d in dirs if d not in keep_set and _iteration_of(d.name) < newest_complete]
    for d in doomed:
        try:
            (d / META).unlink()
        except FileNotFoundError:
            pass
        fsync_dir(d)
        shutil.rmtree(d, ignore_errors=True)
    if doomed:
        fsync_dir(root)
    return doomed


def retention(root: Path, keep_trained: int, export_dir: Path | None = None) -> Retention:
    """The buffer retention to apply once a checkpoint in `root` is saved and pruned: keep every
    rollout from the first one the OLDEST complete checkpoint on disk trains after a resume. Any
    checkpoint left on disk is one `find_resume` may fall back to (the newer ones corrupt), so the
    number kept follows --keep-checkpoints. Dirs without META are never loaded and do not count.
    A checkpoint is named after `progress.trained_rollouts`, which equals its `next_rollout_id`:
    `TrainerProgress.record_trained` takes rollouts only in order, from 0."""
    dirs = [p for p in root.iterdir() if p.is_dir() and (p / META).exists()] if root.is_dir() else []
    its = [it for it in (_iteration_of(p.name) for p in dirs) if it is not None]
    return Retention(keep_trained=keep_trained, keep_from=min(its) if its else None, export_dir=export_dir)


# ------------------------------------------------------------------------------ state


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def has_optimizer_state(opt) -> bool:
    """False before the first step (e.g. the actor during PPO's critic-only warm-up): such an
    optimizer is saved as absent, since megatron can only shard state that exists."""
    parts = getattr(opt, "chained_optimizers", None) or [opt]
    return any(len(getattr(p, "optimizer", p).state) > 0 for p in parts)


# The distributed optimizer's default layout (`fully_sharded_model_space`) builds flattened-range
# shards that megatron-core >= 0.16's dist_checkpointing refuses ("ShardedTensor.flattened_range is
# not supported"); `dp_reshardable` is the layout megatron's own trainer saves by default. The
# plain (non-distributed) optimizers ignore it.
OPTIM_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _sharded_state(st, progress: TrainerProgress | None, *, loading: bool, with_rng: bool,
                   optimizers: set[str]) -> dict[str, Any]:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    rank, world = dist.get_rank(), dist.get_world_size()
    model_sd = st.actor.inner.sharded_state_dict()
    state: dict[str, Any] = {
        "model": model_sd,
        "scheduler": st.actor.scheduler.state_dict(),
        "progress": progress.state_dict() if progress is not None else TrainerProgress().state_dict(),
    }
    if "actor" in optimizers:
        state["optimizer"] = st.actor.optimizer.sharded_state_dict(model_sd, is_loading=loading, metadata=OPTIM_METADATA)
    if with_rng:
        state["rng"] = ShardedObject("rlslurm_rng_state", _rng_state(), (world,), (rank,), replica_id=0)
    if st.critic is not None:
        csd = st.critic.inner.sharded_state_dict(prefix="critic.")
        state["critic"] = csd
        if "critic" in optimizers:
            state["critic_optimizer"] = st.critic.optimizer.sharded_state_dict(csd, is_loading=loading,
                                                                               metadata=OPTIM_METADATA)
        state["critic_scheduler"] = st.critic.scheduler.state_dict()
    return state


def staging_estimate(st) -> int:
    """Bytes this rank stages per save (trainer/ckpt_staging.py): each model's parameters as they are,
    and for each optimizer's own parameters (this rank's fp32 main parameters, a shard under the
    distributed optimizer) themselves and Adam's two moments, fp32. An estimate for reserving the
    staging area ahead; a save that needs more grows it."""
    total = 0
    for role in (st.actor, st.critic):
        if role is None:
            continue
        total += sum(p.numel() * p.element_size() for p in role.inner.parameters())
        for part in getattr(role.optimizer, "chained_optimizers", None) or [role.optimizer]:
            inner = getattr(part, "optimizer", part)
            total += sum(3 * 4 * p.numel() for g in getattr(inner, "param_groups", []) for p in g["params"])
    return total


def _optimizers_with_state(st) -> set[str]:
    out = set()
    if has_optimizer_state(st.actor.optimizer):
        out.add("actor")
    if st.critic is not None and has_optimizer_state(st.critic.optimizer):
        out.add("critic")
    # Every rank must build the same state dict: agree on the union (all ranks step together).
    flags = torch.tensor([float("actor" in out), float("critic" in out)], device=collective_device())
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return {n for n, f in zip(("actor", "critic"), flags.tolist()) if f > 0}


def _in_process_write_results() -> None:
    """Have megatron's checkpoint writer hand its results back through a queue in this process
    instead of a `multiprocessing.Manager` server.

    megatron-core's torch_dist writer (`filesystem_async`) keeps one Manager process for the life of
    the trainer, spawned at the first save, to carry write results from an async save's background
    process. SLURM ends a job by TERMing every process of the step (proctrack/linuxproc, cgroup):
    the Manager, a fresh interpreter with SIGTERM at its default, dies at once, and the TERM's own
    checkpoint then fails with BrokenPipeError when the writer reports its results (measured on a
    real `scontrol requeue`: docs/slurm-preemption.md). rlslurm's writer process (trainer/ckpt_writer.py)
    is forked and reports through a queue of its own, so no Manager is needed."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not isinstance(filesystem_async._results_queue, queue.Queue):
        filesystem_async._results_queue = queue.Queue()


def _mcore_async_strategy() -> dict[str, str]:
    """megatron-core's own asynchronous save machinery, where the installed version lets one choose:
    0.19 defaults `dist_checkpointing.save(async_strategy=...)` to "nvrx", which needs
    nvidia-resiliency-ext (not in the GPU image: its first async save raised ModuleNotFoundError,
    docs/gpu.md); 0.16 has only megatron's own and no such parameter."""
    import inspect

    from megatron.core import dist_checkpointing

    return {"async_strategy": "mcore"} if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters \
        else {}


@dataclass
class Saved:
    """A checkpoint that is complete, verified and `latest`."""

    path: Path
    progress: TrainerProgress  # what it holds (the trainer has moved on since, when it was asynchronous)
    stall_s: float             # the trainer's stop to stage it
    total_s: float             # start to `latest` (rank 0's finalizer moved it)
    staging: str = "none"      # where this rank's copy went: "pinned", "pageable" (ckpt_staging.py)
    stage_s: float = 0.0       # the copy's part of the stall


@dataclass
class _InFlight:
    path: Path
    progress: TrainerProgress
    write: Any            # ckpt_writer.RankWrite
    finalizer: Any        # ckpt_writer.Finalizer on rank 0, else None
    t0: float
    stall_s: float


class Checkpointer:
    """This trainer's checkpoints: at most one save in flight (docs/checkpoints.md, "Asynchronous
    saves"). Every method is collective (every rank calls it at the same point).

    `start` stages a copy of the state and returns: forked writers write it, rank 0's finalizer
    completes it and moves `latest` (trainer/ckpt_writer.py), while the trainer trains or waits for
    rollouts. `poll` (non-blocking) and `wait` (blocking: before a preempt/stop ack, the end of the
    run, the next save) report a finished save to every rank alike; a failed one raises on every
    rank. `asynchronous=False` waits inside `start`."""

    def __init__(self, root: Path, keep: int, *, asynchronous: bool = True):
        self.root, self.keep, self.asynchronous = root, keep, asynchronous
        self.in_flight: _InFlight | None = None

    @staticmethod
    def prepare(st, *, pin: bool = True) -> None:
        """Reserve the staging area in the background on a GPU trainer (trainer/ckpt_staging.py), so
        that the first save does not page-lock it inside its stall. `pin` False: the node has too little
        host memory to page-lock it (trainer/host_memory.py): every save stages in pageable memory. Not
        collective."""
        if not torch.cuda.is_available() or next(st.actor.inner.parameters()).device.type != "cuda":
            return
        from rlslurm.trainer import ckpt_writer

        nbytes = staging_estimate(st)
        log.info("reserving %.1f GiB of %s host memory for checkpoint staging in the background", nbytes / 2**30,
                 "page-locked" if pin else "pageable")
        ckpt_writer.area().allow_pin = pin
        ckpt_writer.area().reserve(nbytes, pin=pin)

    @property
    def pending_iteration(self) -> int | None:
        return None if self.in_flight is None else self.in_flight.progress.trained_rollouts

    def start(self, st, progress: TrainerProgress) -> Saved | None:
        """Stage and hand off the checkpoint of `progress`. Returns a save this had to wait for
        first (or, synchronous, this one)."""
        from megatron.core import dist_checkpointing

        from rlslurm.trainer import ckpt_writer

        before = self.wait() if self.in_flight is not None else None
        t0 = time.perf_counter()
        _in_process_write_results()
        rank, world = dist.get_rank(), dist.get_world_size()
        snapshot = TrainerProgress.from_state_dict(progress.state_dict())
        d = self.root / ckpt_name(snapshot.trained_rollouts)
        try:
            if rank == 0:
                self.root.mkdir(parents=True, exist_ok=True)
                if d.exists():  # a partial save of a crashed attempt, or a re-save of the same iteration
                    if (d / META).exists():
                        (d / META).unlink()
                    shutil.rmtree(d)
                d.mkdir()
                fsync_dir(self.root)
            dist.barrier()
            optimizers = _optimizers_with_state(st)
            strategy = ckpt_writer.keeping_strategy()
            request = dist_checkpointing.save(
                _sharded_state(st, snapshot, loading=False, with_rng=True, optimizers=optimizers), str(d),
                sharded_strategy=strategy, async_sharded_save=True, **_mcore_async_strategy())
            write = ckpt_writer.RankWrite(d, rank, request)
        except (OSError, RuntimeError) as e:  # rank 0's common.pt: the other ranks meet a dead peer at the next
            # collective. torch.save's zip writer reports a full disk as a RuntimeError ("basic_ios::clear:
            # iostream error", "unexpected pos 64 vs 0"), without the errno: the filesystem then says it.
            if not (_is_no_space(e) or (isinstance(e, RuntimeError) and _nearly_full(d))):
                raise
            if rank == 0:
                shutil.rmtree(d, ignore_errors=True)
            raise self._no_space(d, e) from e
        finalizer = None
        if rank == 0:
            finalizer = ckpt_writer.Finalizer(
                d, world, strategy.kept,
                lambda: self._complete(d, snapshot, world, sorted(optimizers)))
            finalizer.start()
        stall = time.perf_counter() - t0
        self.in_flight = _InFlight(d, snapshot, write, finalizer, t0, stall)
        log.info("checkpoint %s staged in %.2f s (the copy %.2f s, %s); writing in the background", d.name,
                 stall, write.stage_s, write.staging)
        if not self.asynchronous:
            return self.wait()
        return before

    def _complete(self, d: Path, progress: TrainerProgress, world: int, optimizers: list[str]) -> None:
        """Rank 0, the finalizer's last step: the completeness mark, a check of every file against
        it, and only then `latest`."""
        write_meta(d, progress.trained_rollouts, world, {"progress": progress.state_dict(), "optimizers": optimizers})
        if (problem := verify(d)) is not None:  # the filesystem's doing: the attempt fails, nothing is final
            raise StorageError(f"{d}: the checkpoint just written does not verify: {problem}; `latest` still "
                               f"names the last complete one")
        write_json_atomic(self.root / LATEST, {"name": d.name, "iteration": progress.trained_rollouts})
        try:
            retry_transient(lambda: prune(self.root, self.keep), self.root, "removing old checkpoints")
        except (OSError, StorageError) as e:  # this checkpoint is complete and `latest`: the next save prunes
            _warn(f"removing old checkpoints in {self.root} failed ({e}); the next save tries again")

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
            full = _is_no_space(error) or _nearly_full(f.path)
            if dist.get_rank() == 0:
                shutil.rmtree(f.path, ignore_errors=True)  # never pointed to; on a full disk, the space
            if full:
                raise self._no_space(f.path, error)
            what = ("; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in sorted(error.items()))
                    if isinstance(error, dict) else f"{type(error).__name__}: {error}")
            # the filesystem failing (EIO that outlasted its retries, a file that does not verify): one
            # line and a failed attempt (docs/shared-filesystem.md), not a traceback
            kind = StorageError if _is_storage_failure(error) else RuntimeError
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


def _causes(error: Any):
    """`error` and everything it wraps (megatron wraps the writers' OSErrors; a dict maps ranks to
    exceptions; megatron's WRAPPED_EXCEPTION is (exception, traceback)), bounded."""
    seen = 0
    todo: list[Any] = [error]
    while todo and seen < 50:
        e = todo.pop()
        seen += 1
        if isinstance(e, dict):
            todo += list(e.values())
        elif isinstance(e, tuple):
            todo += list(e)
        elif isinstance(e, BaseException):
            todo += [e.__cause__, e.__context__, *getattr(e, "failures", {}).values()]
            yield e
        elif e is not None:
            yield e


def transient_os_error(error: Any) -> OSError | None:
    """The EIO / ESTALE / EAGAIN a failure comes from, if it does (buffer/atomic.py TRANSIENT_ERRNOS)."""
    return next((e for e in _causes(error) if isinstance(e, OSError) and e.errno in TRANSIENT_ERRNOS), None)


def _is_storage_failure(error: Any) -> bool:
    return any(isinstance(e, (StorageError, TransientStorageError)) or
               (isinstance(e, OSError) and e.errno in TRANSIENT_ERRNOS) for e in _causes(error))


def _is_no_space(error: BaseException | str | None) -> bool:
    """Does a failure (megatron wraps the writers' OSErrors) come from a full disk or quota?"""
    for e in _causes(error):
        if isinstance(e, StorageFull) or (isinstance(e, OSError) and e.errno in NO_SPACE_ERRNOS):
            return True
        text = str(e).lower()
        if "no space left on device" in text or "disk quota exceeded" in text:
            return True
    return False


def _nearly_full(path: Path) -> bool:
    """Is the filesystem holding `path` out of space (under 64 MiB or 1 % free, whichever is less)?"""
    try:
        st = os.statvfs(path if path.exists() else path.parent)
    except OSError:
        return False
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    return free < min(64 * 2**20, total / 100)


def checkpoint_bytes(d: Path) -> int:
    try:
        meta = json.loads((d / META).read_text())
        return sum(int(f["size"]) for f in meta.get("files", {}).values())
    except (OSError, ValueError, KeyError, TypeError):
        return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def find_complete(root: Path) -> Path | None:
    """The newest checkpoint with its completeness mark (not re-verified: for sizes and messages)."""
    for d in candidates(root):
        if (d / META).exists():
            return d
    return None


def sweep_incomplete(root: Path, min_age_s: float = 600.0) -> list[Path]:
    """Rank 0 at start-up: remove checkpoint directories a killed save left without their
    completeness mark (never loadable; on a full disk, likely what fills it). Only those whose
    newest file is older than `min_age_s`: a zombie trainer of an earlier attempt may still write."""
    if not root.is_dir():
        return []
    removed = []
    now = time.time()
    for d in root.iterdir():
        if not d.is_dir() or _iteration_of(d.name) is None or (d / META).exists():
            continue
        newest = max((p.stat().st_mtime for p in d.rglob("*")), default=d.stat().st_mtime)
        if now - max(newest, d.stat().st_mtime) < min_age_s:
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    if removed:
        fsync_dir(root)
        _warn(f"removed {len(removed)} checkpoint(s) a killed save left incomplete: {[d.name for d in removed]}")
    return removed


def _materialize_state(opt) -> None:
    """A fresh distributed optimizer has no Adam state, and megatron (without TE/Apex) cannot build
    the sharded template to load into (`assert len(steps) == 1` in its state_dict). Megatron's own
    trainer first takes one zero-gradient step; the dummy values (and the parameters it touched)
    are then overwritten by the checkpoint."""
    for part in getattr(opt, "chained_optimizers", None) or [opt]:
        if hasattr(part, "_init_optimizer_states_with_dummy_values") and not has_optimizer_state(part):
            part._init_optimizer_states_with_dummy_values()


def _restore_steps(opt) -> None:
    """Give every parameter its own, correct Adam `step` after a load.

    megatron's distributed optimizer without TE/Apex (torch Adam) keeps the step count in each
    parameter's state but checkpoints it once, in the param_groups. Its `load_state_dict` then
    restores it wrongly twice over: it puts ONE tensor in every parameter's state (torch increments
    it in place per parameter, so the bias correction would run ahead), and the `dp_reshardable`
    loader afterwards copies the load template's step over it — the value of the dummy step taken
    by `_materialize_state` (1), not the checkpoint's. The param_groups' `step` is the
    checkpoint's value: rebuild every parameter's step from it. Other optimizers checkpoint the
    step per parameter and only need the sharing undone."""
    for part in getattr(opt, "chained_optimizers", None) or [opt]:
        inner = getattr(part, "optimizer", part)
        for group in inner.param_groups:
            for p in group["params"]:
                st = inner.state.get(p)
                if not st or not isinstance(st.get("step"), torch.Tensor):
                    continue
                if _is_distributed(part) and "step" in group:
                    st["step"] = torch.tensor(float(group["step"]), dtype=st["step"].dtype, device=st["step"].device)
                else:
                    st["step"] = st["step"].clone()


def _is_distributed(part) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(part, DistributedOptimizer)


def load(st, d: Path) -> TrainerProgress:
    """Collective: restore everything `save` wrote into the built trainer."""
    from megatron.core import dist_checkpointing

    meta = json.loads((d / META).read_text())
    same_world = meta.get("world_size") == dist.get_world_size()
    if not same_world:
        _warn(f"{d} was saved by {meta.get('world_size')} ranks, this job has {dist.get_world_size()}: "
              "RNG states are not restored (weights, optimizer and progress are)")
    optimizers = set(meta.get("optimizers", []))
    if "actor" in optimizers:
        _materialize_state(st.actor.optimizer)
    if "critic" in optimizers and st.critic is not None:
        _materialize_state(st.critic.optimizer)
    template = _sharded_state(st, None, loading=True, with_rng=same_world, optimizers=optimizers)
    state = dist_checkpointing.load(template, str(d))
    st.actor.inner.load_state_dict(state["model"])
    if "actor" in optimizers:
        with torch.no_grad():  # fp32 runs: the optimizer's main params are views of the model's leaves
            st.actor.optimizer.load_state_dict(state["optimizer"])
        _restore_steps(st.actor.optimizer)
    st.actor.scheduler.load_state_dict(state["scheduler"])
    if st.critic is not None:
        if "critic" not in state:
            raise DataError(str(d), "checkpoint has no critic but --advantage-estimator ppo needs one")
        st.critic.inner.load_state_dict({k.removeprefix("critic."): v for k, v in state["critic"].items()})
        if "critic" in optimizers:
            with torch.no_grad():
                st.critic.optimizer.load_state_dict(state["critic_optimizer"])
            _restore_steps(st.critic.optimizer)
        st.critic.scheduler.load_state_dict(state["critic_scheduler"])
    if same_world:
        _set_rng_state(state["rng"])
    return TrainerProgress.from_state_dict(state["progress"])


def resume(st, root: Path) -> tuple[TrainerProgress, Path | None]:
    """Find the newest intact checkpoint (rank 0 decides for all) and load it. One that verifies but
    fails to load on any rank (a bit flip past the checksummed size, an I/O error while megatron reads
    it) is passed over with one warning for the previous complete one; when none loads, the attempt
    fails (never a silent start from scratch over trained progress)."""
    from rlslurm.errors import UserError

    failed: dict[Path, str] = {}
    while True:
        choice = [None]
        if dist.get_rank() == 0:
            if not failed:
                sweep_incomplete(root)
            found = find_resume(root, frozenset(failed))
            choice = [str(found) if found is not None else None]
        dist.broadcast_object_list(choice, src=0)
        if choice[0] is None:
            if failed:
                raise RuntimeError(f"{root}: no checkpoint loads ("
                                   + "; ".join(f"{d.name}: {why}" for d, why in failed.items())
                                   + "); this attempt fails and is requeued (--max-failures)")
            return TrainerProgress(), None
        d = Path(choice[0])
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
        if not any(errors):
            assert progress is not None
            return progress, d
        failed[d] = next(e for e in errors if e)
        if dist.get_rank() == 0:
            _warn(f"checkpoint {d} verifies but does not load ({failed[d]}); falling back to the previous "
                  f"complete one")


def load_model_weights(model: torch.nn.Module, path: Path) -> None:
    """Initial weights from a Megatron dist checkpoint: one of ours (a checkpoints root with
    `latest`, or an iter_ directory) or a plain model checkpoint (`rlslurm convert hf-to-mcore`)."""
    from megatron.core import dist_checkpointing

    d = Path(path)
    if (d / LATEST).exists() or any(_iteration_of(p.name) is not None for p in d.iterdir() if p.is_dir()):
        found = find_resume(d)
        if found is None:
            raise DataError(str(d), "--load: no complete checkpoint in this directory")
        d = found
    if not (d / "metadata.json").exists():
        raise DataError(str(d), "--load: not a megatron distributed checkpoint (no metadata.json)")
    keyed = (d / META).exists()
    sd = model.sharded_state_dict()
    state = dist_checkpointing.load({"model": sd} if keyed else sd, str(d))
    model.load_state_dict(state["model"] if keyed else state)
