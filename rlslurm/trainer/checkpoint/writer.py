"""A checkpoint written in the background while the trainer trains on (checkpointer.py
`Checkpointer` drives it; docs/checkpoints.md, "Asynchronous saves").

megatron-core's `dist_checkpointing.save(..., async_sharded_save=True)` plans the save (collectives),
writes `common.pt` and returns an `AsyncRequest`: the function that writes this rank's shard files
from "write buckets", and finalize functions that gather every rank's write results and write the
global `.metadata` and `metadata.json`. megatron schedules those with its `AsyncCallsQueue`, whose
completion check is a CUDA all-reduce and whose finalize is a collective that every rank must call
at the same point of its loop. rlslurm's trainer spends most of its time waiting for rollouts, where
no collective point exists, and the checkpoint must become `latest` there too (a hard kill then
loses nothing it had written). So the pieces are run differently:

1. `stage`: the tensors of the write buckets are copied off the live model into this process's
   staging area (staging.py: shared memory, page-locked for the GPU's copy),
   synchronously. This copy is the training stall; after it the trainer may change its weights
   freely.
2. `RankWrite`: a forked process writes this rank's files with megatron's own writer (which forks
   its per-bucket workers) and then publishes the write results as `<dir>/.rlslurm-write-<rank>.pkl`.
   A transient error of the shared filesystem (EIO, ESTALE, EAGAIN) repeats the whole write from the
   staged copy, which stays until this process exits (buffer/atomic.py `retry_transient`, its bounds).
   Its outcome (ok, or the exception) comes back over a pipe, and `Checkpointer.poll`/`wait` pass
   every rank's to every rank: a failure cannot travel through a file the full disk refuses.
   A forked process inherits the trainer's TERM handling (trainer/main.py `_on_term`), so SLURM's
   TERM to every process of the step does not stop the save, and it reads the staged copy from the
   area's descriptor (the next save waits for this writer before it rewrites the area).
3. `Finalizer` (rank 0, a thread): once every rank's results file is there, writes `.metadata`
   (megatron's storage writer `finish`) and `metadata.json`, then calls back into checkpointer.py,
   which writes `rlslurm.json`, verifies the directory and only then moves `latest`; each of these
   steps is retried on a transient error like the ranks' writes.

No collective runs outside the trainer's own calls (`Checkpointer.poll` / `wait`), so nothing here
can interleave with the trainer's collectives. A SIGKILL at any point leaves a directory without
`rlslurm.json`, never pointed to (directory.py `find_resume` skips it; `sweep_incomplete` removes
it).
"""

from __future__ import annotations

import atexit
import gc
import logging
import multiprocessing as mp
import os
import pickle
import queue
import threading
import time
from itertools import chain
from pathlib import Path
from typing import Any, Callable

from rlslurm.buffer.atomic import listdir_fresh, retry_transient, write_bytes_atomic
from rlslurm.trainer.checkpoint.failures import transient_os_error
from rlslurm.trainer.checkpoint.staging import area, open_slots

log = logging.getLogger(__name__)

RESULTS_PREFIX = ".rlslurm-write-"
POLL_S = 0.2  # the finalizer's look for the ranks' results files
# Test hook (tests only): seconds each rank's writer holds its results after writing its files,
# standing in for a real model's write on a CPU-sized one (tests/trainer/test_term_save.py,
# tests/trainer/test_async_checkpoint.py). Unset in every real run. "@PATH": the seconds are read from
# the file PATH at each save (absent or empty: 0), so a soak can open and close the window while the
# run goes on (bench/bench_chaos.py).
TEST_SAVE_DELAY_ENV = "RLSLURM_TEST_SAVE_DELAY_S"


def results_path(d: Path, rank: int) -> Path:
    return d / f"{RESULTS_PREFIX}{rank}.pkl"


def keeping_strategy():
    """megatron's default torch_dist save strategy, keeping the storage writer and the global
    metadata its `async_save` plans (coordinator only) for the `Finalizer`. The override point,
    `_get_save_and_finalize_callbacks(writer, save_state_dict_ret[, async_strategy])`, is where
    megatron-core turns exactly these into its own (collective) finalize function (0.16.1; 0.19.2
    adds the async strategy's name)."""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    class KeepingStrategy(TorchDistSaveShardedStrategy):
        kept: tuple[Any, Any] | None = None

        def _get_save_and_finalize_callbacks(self, writer, save_state_dict_ret, *strategy):
            self.kept = (writer, save_state_dict_ret[1])
            return super()._get_save_and_finalize_callbacks(writer, save_state_dict_ret, *strategy)

    return KeepingStrategy("torch_dist", 1)


def in_process_write_results() -> None:
    """Have megatron's checkpoint writer hand its results back through a queue in this process
    instead of a `multiprocessing.Manager` server.

    megatron-core's torch_dist writer (`filesystem_async`) keeps one Manager process for the life of
    the trainer, spawned at the first save, to carry write results from an async save's background
    process. SLURM ends a job by TERMing every process of the step (proctrack/linuxproc, cgroup):
    the Manager, a fresh interpreter with SIGTERM at its default, dies at once, and the TERM's own
    checkpoint then fails with BrokenPipeError when the writer reports its results (measured on a
    real `scontrol requeue`: docs/slurm-preemption.md). rlslurm's writer process (`RankWrite`) is
    forked and reports through a queue of its own, so no Manager is needed."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not isinstance(filesystem_async._results_queue, queue.Queue):
        filesystem_async._results_queue = queue.Queue()


def mcore_async_strategy() -> dict[str, str]:
    """megatron-core's own asynchronous save machinery, where the installed version lets one choose:
    0.19 defaults `dist_checkpointing.save(async_strategy=...)` to "nvrx", which needs
    nvidia-resiliency-ext (not in the GPU image: its first async save raised ModuleNotFoundError,
    docs/gpu.md); 0.16 has only megatron's own and no such parameter."""
    import inspect

    from megatron.core import dist_checkpointing

    return {"async_strategy": "mcore"} if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters \
        else {}


def stage(write_buckets: list) -> list:
    """Every tensor the buckets would write, copied into the staging area (module docstring, 1); the
    buckets come back with a `staging.Slot` where each tensor was."""
    tensors = [t for _, _, (_, tensor_data) in write_buckets for _, t in tensor_data]
    slots = iter(area().stage(tensors))
    return [(file_name, key, (bytes_data, [(item, next(slots)) for item, _ in tensor_data]))
            for file_name, key, (bytes_data, tensor_data) in write_buckets]


def unstage(buckets: list, fd: int, size: int) -> list:
    """In the writer: the buckets with the staged tensors in place of their slots."""
    slots = [s for _, _, (_, data) in buckets for _, s in data]
    tensors = iter(open_slots(fd, size, slots))
    return [(file_name, key, (bytes_data, [(item, next(tensors)) for item, _ in data]))
            for file_name, key, (bytes_data, data) in buckets]


def _test_delay() -> float:
    v = os.environ.get(TEST_SAVE_DELAY_ENV) or ""
    if v.startswith("@"):
        try:
            v = Path(v[1:]).read_text().strip()
        except FileNotFoundError:
            return 0.0
    return float(v or 0)


def _dump(path: Path, out: Any) -> None:
    write_bytes_atomic(path, pickle.dumps(out))


def _picklable(e: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # an exception that does not pickle: its words do
        return RuntimeError(f"{type(e).__name__}: {e}")


# What the forked writer runs: set just before the fork and cleared right after (the child has its
# own copy of the references; the staged tensors themselves it maps from the area's descriptor).
_JOB: tuple | None = None
_JOB_PARENT = 0  # the rank's pid, for the writer's watch (set with _JOB)


ORPHAN_POLL_S = 0.5  # how often a writer looks whether its rank is still there


def _die_with_rank(rank_pid: int, poll_s: float = ORPHAN_POLL_S) -> None:
    """In the writer: end it (and the bucket workers megatron's writer forked) once its rank is gone.
    A rank killed with SIGKILL (OOM killer, a kill -9) leaves its writer re-parented; nothing will
    finalize what it writes, and it ignores the step's TERM (the trainer's handling, inherited), so
    where the step's processes are not tracked by a cgroup it would run on and could publish its files
    and results into the directory a later attempt re-saves under the same name (bench/bench_chaos.py
    ckpt_kill: both writers alive after their ranks' kill). A pid never comes back as one's parent."""
    from rlslurm.engines import procfs

    def watch() -> None:
        while os.getppid() == rank_pid:
            time.sleep(poll_s)
        for pid in procfs.descendants(os.getpid()):
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        os._exit(1)

    threading.Thread(target=watch, name="rlslurm-ckpt-writer-orphan-watch", daemon=True).start()


def _write_once(fn, args, fd: int, size: int, n_buckets: int) -> Any:
    """One try of this rank's write: megatron's writer over the staged copy. Its files are opened for
    writing afresh (truncated), so a try after a failed one rewrites them whole from the same copy. A
    transient error (EIO, ESTALE, EAGAIN: megatron hands its workers' OSErrors back as results) is
    raised, for `retry_transient` to try again."""
    q: queue.Queue = queue.Queue()  # megatron's writer reports here (in-process: no Manager)
    fn(args[0], unstage(args[1], fd, size), q)
    out = q.get_nowait()
    if isinstance(out, BaseException):
        if (transient := transient_os_error(out)) is not None:
            raise transient
        return out
    return (list(chain.from_iterable(out.values())) if len(out) == n_buckets else
            RuntimeError(f"incomplete write results: {len(out)} of {n_buckets} buckets"))


def _child() -> None:
    gc.disable()  # collecting the trainer's CUDA tensors in a forked child would call into CUDA
    fn, args, results, n_buckets, report, (fd, size) = _JOB  # type: ignore[misc]
    _die_with_rank(_JOB_PARENT)
    try:
        # the shared filesystem's hiccups, with the bounds of every other write (buffer/atomic.py)
        out = retry_transient(lambda: _write_once(fn, args, fd, size, n_buckets), results.parent,
                              f"writing the checkpoint files of rank {results.name[len(RESULTS_PREFIX):-4]}")
    except BaseException as e:
        out = e
    if (delay := _test_delay()) > 0:
        log.warning("%s=%s: this rank's write is held %.0f s (a test hook)", TEST_SAVE_DELAY_ENV, delay, delay)
        time.sleep(delay)
    if isinstance(out, BaseException):
        report.send(("error", _picklable(out)))  # rank 0 learns it from the trainer (Checkpointer.poll/wait)
        return
    try:
        _dump(results, out)  # for rank 0's finalizer
    except BaseException as e:  # a full disk refuses even this small file
        report.send(("error", _picklable(e)))
        return
    report.send(("ok", None))


_LIVE: set["RankWrite"] = set()


class RankWrite:
    """This rank's part of one checkpoint, written by a forked process (module docstring, 2). Its
    outcome comes back over a pipe, ("ok", None) or ("error", exception): a failure must reach the
    other ranks through the trainer's collectives, as a results file may be what the disk refuses."""

    def __init__(self, d: Path, rank: int, request) -> None:
        global _JOB, _JOB_PARENT
        self.results = results_path(d, rank)
        self.proc: mp.process.BaseProcess | None = None
        self.outcome: tuple[str, BaseException | None] | None = None
        self.staging, self.stage_s = "none", 0.0  # how this rank's copy was staged, and how long it took
        if request.async_fn is None:  # nothing of this rank's to write
            _dump(self.results, [])
            self.outcome = ("ok", None)
            return
        args = list(request.async_fn_args)
        t = time.perf_counter()
        buckets = stage(args[1])
        self.stage_s, self.staging = time.perf_counter() - t, area().staging
        ctx = mp.get_context("fork")
        self._recv, send = ctx.Pipe(duplex=False)
        _JOB = (request.async_fn, (args[0], buckets), self.results, len(buckets), send,
                (area().fd, area().size))
        _JOB_PARENT = os.getpid()
        del buckets, args
        try:
            self.proc = ctx.Process(target=_child, name=f"rlslurm-ckpt-writer-{rank}", daemon=False)
            self.proc.start()
        finally:
            _JOB = None
            send.close()
        _LIVE.add(self)

    def status(self, block: bool = False) -> tuple[str, BaseException | None] | None:
        """None while the writer runs; then its outcome (a writer that died says so)."""
        if self.outcome is None and (block or self._recv.poll()):
            try:
                self.outcome = self._recv.recv()
            except EOFError:  # gone without a word: killed (OOM, SIGKILL)
                self.proc.join()
                self.outcome = ("error", RuntimeError(f"checkpoint writer {self.proc.pid} exited with "
                                                      f"{self.proc.exitcode} before it reported"))
            self.proc.join()
            _LIVE.discard(self)
        return self.outcome

    def kill(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        _LIVE.discard(self)


@atexit.register
def _kill_live_writers() -> None:
    """A trainer that exits with a save in flight (a crash, a superseded attempt) does not wait for
    it: nothing would finalize it. Runs before multiprocessing's own exit hook, which would join."""
    for w in list(_LIVE):
        w.kill()


class CheckpointWriteFailed(Exception):
    """Some rank's write failed; `failures` maps its rank to the exception."""

    def __init__(self, d: Path, failures: dict[int, BaseException]):
        self.failures = failures
        what = "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in sorted(failures.items()))
        super().__init__(f"{d}: writing the checkpoint failed: {what}")


class Finalizer(threading.Thread):
    """Rank 0: completes the checkpoint once every rank's files are written (module docstring, 3).
    `complete()` (checkpointer.py) writes rlslurm.json, verifies and moves `latest`. `outcome` is None
    while it runs, then ("ok", None) or ("error", exception). A rank whose writer failed never
    publishes its results: `Checkpointer` then stops this thread (`stop`)."""

    def __init__(self, d: Path, world: int, kept: tuple[Any, Any], complete: Callable[[], None]):
        super().__init__(name=f"rlslurm-ckpt-finalize-{d.name}", daemon=True)
        self.d, self.world, self.kept, self.complete = d, world, kept, complete
        self.outcome: tuple[str, BaseException | None] | None = None
        self.t_done: float | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        try:
            results = self._gather()
            failures = {r: out for r, out in enumerate(results) if isinstance(out, BaseException)}
            if failures:
                raise CheckpointWriteFailed(self.d, failures)
            writer, metadata = self.kept
            from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

            # .metadata (every rank's write results) and metadata.json: each rewritten whole by a try
            retry_transient(lambda: writer.finish(metadata, results), self.d, "writing .metadata")
            retry_transient(lambda: save_config(CheckpointingConfig("torch_dist", 1), str(self.d)), self.d,
                            "writing metadata.json")
            for r in range(self.world):
                results_path(self.d, r).unlink(missing_ok=True)
            self.complete()
            self.t_done = time.perf_counter()
            self.outcome = ("ok", None)
        except BaseException as e:  # reported to every rank by Checkpointer.poll / wait
            self.t_done = time.perf_counter()
            self.outcome = ("error", e)

    def _gather(self) -> list[Any]:
        want = {results_path(self.d, r).name for r in range(self.world)}
        while not want <= set(listdir_fresh(self.d)):
            if self._halt.wait(POLL_S):
                raise RuntimeError(f"{self.d}: finalizing stopped before every rank had written")
        def load(path: Path) -> Any:
            with open(path, "rb") as f:
                return pickle.load(f)

        return [retry_transient(lambda p=results_path(self.d, r): load(p), results_path(self.d, r), "reading it")
                for r in range(self.world)]

    def stop(self) -> None:
        self._halt.set()
