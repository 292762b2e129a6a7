"""--colocate: the trainer and the engines take turns on the same GPUs (docs/colocate.md).

The driver generates rollout N only once the engines serve version N (colocated runs are synchronous,
resolve refuses --async-buffer-size), so between "rollout N committed" and "version N+1 published"
the engines are idle and the trainer owns the GPUs. Per rollout, in the trainer's loop
(trainer/main.py), rank 0 talking to the engines, every rank moving its own tensors:

    engines   pause (abort anything left), release weights + KV cache + CUDA graphs   time/engines_release
    trainer   onload: params, optimizer state, ref and critic back, grads as zeros     time/onload
    ...       train, checkpoint if due
    trainer   offload everything but the actor's params (the export reads those)       time/offload
    engines   resume their weights' memory
    ...       publish version N+1 (the broadcast, over gloo: NCCL refuses two ranks on one GPU)
    trainer   offload the actor's params                                               (time/offload)
    engines   resume KV cache + CUDA graphs, continue generating                       time/engines_resume

Which of the trainer's tensor sets move (params, grads, the rest: trainer/tensor_sets.py) is decided
before the first offload: all with --offload-train, none with --no-offload-train, and by default
the cheapest moves that fit beside the engines (trainer/offload_choice.py), re-checked at every
turn's end against what the engines left the trainer (`_recheck`). A set that stays
is not moved by any phase: each "offload" then only gives the blocks the trainer's cache holds (the
activations') back to the driver, for the engines.

On CUDA each phase also records how much of the GPU is in use by every process on it (torch's
mem_get_info: the engines' memory is another process's), `mem/gpu_used_gib/<after phase>`, and the
trainer's own peak (`mem/trainer_peak_reserved_gib`, the caching allocator's high-water mark from the
onload to the offload): the peak of the GPU while training is at most the sum of the first after
the release and that.

Each engine call is bounded by --weight-sync-timeout-s and fails the step like a failed sync (the
job is then requeued); one that fails because the job is ending (a TERM, a preempt or stop request:
the engines go down with it) raises `EnginesGone` instead, and the trainer checkpoints what it
trained before it exits (trainer/main.py). An engine whose process went away in a turn (it crashed,
or a rank of an engine spanning nodes died and took the engine down: its url refuses connections)
does not end the trainer: at the release the turn puts back the engines it had released, waits for
every engine to be up again (its supervisor restarts it once the bracket is let go) and releases
again, up to RELEASE_TRIES times; in the resume phases it is left out (restarted after the turn, it
gets the weights from the next publish like any restarted engine). The turn resumes only the engines
it released (the same process: url and pid): an engine that came up or was restarted since holds its
memory, and SGLang's resume of a tag it never released kills the server (KeyError in
`resume_memory_occupation`, found by tools/gpu/field-colocate.sh); so each turn also starts only once
every engine is up (trainer/main.py).

While the engines are released they cannot answer a health check (SGLang's
/health generates a token), so rank 0 holds the weight-update bracket (control/weight_update.json,
engines/update_watch.py) for the whole window and renews it in a thread while the trainer trains.

What moves and how: trainer/tensor_sets.py (by storage, every view valid again afterwards). On
--device cpu the same moves run within host memory (what the CPU tests exercise); the engines'
release then only flushes their cache (docs/sglang-behaviour.md).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist

from rlslurm.trainer.offload_choice import LABELS, SETS, Choice, pending_optimizer_bytes, recheck
from rlslurm.trainer.tensor_sets import (
    LateCopy,
    PinBudget,
    TensorSet,
    grad_tensors,
    optimizer_state,
    other_tensors,
    trainer_tensor_sets,
    warm_process_groups,
)

log = logging.getLogger(__name__)

# SGLang's GPU_MEMORY_TYPE_* tags (sglang/srt/constants.py)
WEIGHTS, KV_CACHE, CUDA_GRAPH = "weights", "kv_cache", "cuda_graph"
RELEASE_TRIES = 3
SAVE_RELEASE_S = 10.0  # each engine call of the release before the job's last save (release_for_save): a TERM's
                       # save must fit SLURM's KillWait; engines gone with the job refuse at once
GONE_WAIT_S = 30.0  # how long a failed engine has to stop listening to count as gone (SGLang ends a
                    # spanning engine's rank 0 about 6 s after another rank died: docs/sglang-behaviour.md)


# --- the phases ---------------------------------------------------------------------------------

def let_engines_start(st: Any, control: Any, *, attempt: int, rank: int, bucket_bytes: int,
                      trains_beside: bool, choice: Choice | None = None, rest_on_gpu: int = 0) -> int:
    """The trainer shares its GPUs with engines (--colocate, --shared-gpu) and has built its model (and,
    colocated, moved off the GPUs what `choice` moves): rank 0 records, per GPU, what the trainer may take
    beside engines that hold their whole share (engines/memory_share.py `trainer_margin`: its params
    unless they stay on the GPU anyway; `trains_beside`: it also trains while they generate,
    --shared-gpu), and the choice. The rollout nodes start their engines only then, so that each sizes
    its share on what the trainer leaves. `rest_on_gpu`: the bytes of the rest (trainer/tensor_sets.py) on
    this rank's GPU now. Collective; returns this rank's margin (0 on CPU)."""
    from rlslurm.buffer.control import ColocationMemory, OffloadRecord
    from rlslurm.gpus import torch_device_uuid

    mine = ("", 0)
    if st.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(st.device)
        mine = (torch_device_uuid(torch.cuda.current_device()) or "",
                rank_margin(st, choice, bucket_bytes, total, trains_beside=trains_beside, rest_on_gpu=rest_on_gpu))
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if rank == 0:
        margins: dict[str, int] = {}
        for uuid, margin in every:
            margins[uuid] = max(margins.get(uuid, 0), margin)
        offload = None if choice is None else OffloadRecord(
            setting=choice.setting, keeps=list(choice.keeps), moves=list(choice.moves), line=choice.line,
            terms_gib={k: round(v, 3) for k, v in choice.terms_gib.items()},
            auto_keeps=None if choice.auto_keeps is None else list(choice.auto_keeps),
            rest_kept_gib=round(choice.keep_rest / 2**30, 3))
        control.write_colocation_memory(ColocationMemory(attempt=attempt, margins=margins, offload=offload))
        log.info("the trainer shares its GPUs with the engines: they may start now (the trainer's margin beside "
                 "them: %s)", ", ".join(f"{m / 2**30:.2f} GiB" for m in margins.values()))
    return mine[1]


def rank_margin(st: Any, choice: Choice | None, bucket_bytes: int, total: int, *, trains_beside: bool,
                rest_on_gpu: int = 0) -> int:
    """What this rank may take on its GPU beside the engines after they have sized their share on what is
    free now (engines/memory_share.py `trainer_margin`): its params unless they stay resident anyway, and
    what its state on the GPU has yet to grow by while the engines hold their share: Adam's moments, made
    at the first step, where the optimizer state stays (offload_choice.pending_optimizer_bytes; none
    when it was loaded from a checkpoint; moved, the moments leave with it: `Colocation.to_engines_for_weights`;
    moved but for `choice.keep_rest`, those of them that fit in what of it is not on the GPU yet, `rest_on_gpu`).
    Without them, a trainer that keeps its optimizer state took them out of the engines' share at its
    first step, and the engines' resume after it ran out of memory (qwen3-1.7B on one H100: 12.8 GiB;
    bench/results/gpu-lease-2026-12-07.md)."""
    from rlslurm.engines.memory_share import trainer_margin

    keeps = SETS if choice is None else choice.keeps
    params = 0 if "params" in keeps else sum(p.numel() * p.element_size() for p in st.actor.model.parameters())
    pending = pending_optimizer_bytes(st, st.device)
    if choice is not None and "rest" in choice.moves:  # of those, only what fits in what of the rest stays
        pending = min(pending, max(0, choice.keep_rest - rest_on_gpu))
    return trainer_margin(params, bucket_bytes, total, trains_beside=trains_beside) + pending


class EnginesGone(RuntimeError):
    """An engine phase failed while the job is ending: the trainer checkpoints and exits."""


def _disconnected(e: BaseException) -> bool:
    from rlslurm.engines.sglang_client import SGLangError, SGLangTimeout

    return isinstance(e, SGLangError) and e.status is None and not isinstance(e, SGLangTimeout)


class EnginesLost(RuntimeError):
    """Engines whose process went away during a phase (their url refuses connections); the others
    answered."""

    def __init__(self, gone: list[Any], first: BaseException):
        super().__init__(f"{', '.join(t.url for t in gone)} went away ({type(first).__name__}: {first})")
        self.gone = gone


class Colocation:
    """Collective over the trainer (every rank calls each phase); rank 0 talks to the engines.
    `ending` (rank 0's): is the job being ended (TERM, preempt or stop request)?"""

    def __init__(self, st: Any, control: Any, api_key: str | None, *, rank: int, timeout_s: float,
                 ending=lambda: False, moves: Iterable[str] = SETS):
        """`moves`: which of the trainer's tensor sets (offload_choice.SETS) leave the GPU while the engines
        generate (settable until the first offload: trainer/turns.py decides after the sets are known, and
        how much of their host copies may be page-locked: `pin_within`)."""
        self.control, self.api_key, self.rank, self.timeout_s = control, api_key, rank, timeout_s
        self.ending = ending
        self._released: set[tuple[str, int | None]] = set()  # (url, pid) of the engines this turn released
        self.st = st
        self.cuda = st.device.type == "cuda"  # GPU memory to move and to measure; on cpu the moves are empty
        if self.cuda:
            # megatron marks expert parameters allreduce=False (their gradients go over the expert DP group)
            warm_process_groups(st.device, experts=any(not getattr(p, "allreduce", True)
                                                       for p in st.actor.model.parameters()))
        self.params, self.grads, self.rest = trainer_tensor_sets(st, st.device)
        self.sets = {"params": self.params, "grads": self.grads, "rest": self.rest}
        self.moves = tuple(moves)
        self.times: dict[str, float] = {}  # and mem/*: the metrics of the last rollout's phases
        self._keeper: _BracketKeeper | None = None
        self._room: int | None = None  # auto: what this rank may hold beside the engines (`watch_growth`)
        self._late: LateCopy | None = None  # the optimizer state's copy back under way (`to_trainer`)
        for tr in (st.actor, st.critic):
            if tr is not None:
                tr.before_step = self.finish_onload
        self._attempt = 0

    @property
    def moves(self) -> tuple[str, ...]:
        return self._moves

    @moves.setter
    def moves(self, names: Iterable[str]) -> None:
        names = set(names)
        if names - set(SETS):
            raise ValueError(f"no tensor set {sorted(names - set(SETS))} (the sets: {SETS})")
        self._moves = tuple(s for s in SETS if s in names)
        self._moving = tuple(self.sets[s] for s in self._moves)

    def copy_bytes(self) -> int:
        """This rank's bytes that move with a host copy (the gradients are dropped, not copied), the moments
        its optimizer makes at the first step included, less what of the rest stays (`keep`)."""
        out = self.params.nbytes if "params" in self.moves else 0
        if "rest" in self.moves:
            out += max(0, self.rest.nbytes + pending_optimizer_bytes(self.st, self.st.device) - self.rest.keep)
        return out

    def pin_within(self, budget: int | None) -> None:
        """Page-lock the host copies up to `budget` bytes (None: all), the rest pageable: set before the
        first offload, which makes them."""
        self.params.budget = self.rest.budget = PinBudget(budget)

    def _engines(self, method: str, *, released_only: bool = False, **kw: Any) -> list:
        """`method` on every healthy engine (or only on those this turn released); the engines called."""
        from rlslurm.engines.fanout import Engines, HttpLoop, engine_targets

        targets = engine_targets(self.control.engines())
        if released_only:
            left = [t.url for t in targets if (t.url, t.pid) not in self._released]
            if left:
                log.warning("colocate: %s not released in this turn (started or restarted since): holds its "
                            "memory, not resumed", ", ".join(left))
            targets = [t for t in targets if (t.url, t.pid) in self._released]
        if not targets:
            return []
        loop = HttpLoop()
        engines = Engines(loop, targets, self.api_key)
        try:
            futs = engines.submit(method, timeout=self.timeout_s, **kw)
            done, pending = cf.wait(futs, timeout=self.timeout_s + 5)
            for f in pending:
                f.cancel()
            if pending:
                raise TimeoutError(f"{method}: {len(pending)} engine(s) did not answer within {self.timeout_s:g} s")
            failed = [(t, f.exception()) for t, f in zip(targets, futs) if f.exception() is not None]
            if failed:
                # only a dropped or refused connection may mean the process went away; an answer or a
                # timeout (a hung engine) fails the phase at once
                other = next((e for _, e in failed if not _disconnected(e)), None)
                if other is not None:
                    raise other
                gone = self._gone(loop, [t for t, _ in failed])
                if len(gone) < len(failed):  # one is there and failed: not ours to paper over
                    raise next(e for t, e in failed if t not in gone)
                raise EnginesLost(gone, failed[0][1])
        finally:
            engines.close()
            loop.close()
        return targets

    @staticmethod
    def _gone(loop: Any, targets: list) -> list:
        """Those of `targets` that stop listening within GONE_WAIT_S (their process ended)."""
        from rlslurm.engines.fanout import REFUSED_TIMEOUT_S, refusing

        deadline, gone = time.monotonic() + GONE_WAIT_S, set()
        while True:
            left = [t.url for t in targets if t.url not in gone]
            gone |= set(loop.submit(refusing(left)).result(timeout=REFUSED_TIMEOUT_S + 5))
            if len(gone) == len(targets) or time.monotonic() > deadline:
                return [t for t in targets if t.url in gone]
            time.sleep(1.0)

    def _wait_for_restart(self, lost: list) -> None:
        """Rank 0: until every engine is healthy again, none of them a process in `lost` (bounded)."""
        from rlslurm.engines.fanout import engine_targets

        was = {(t.url, t.pid) for t in lost}
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            recs = self.control.engines()
            if recs and all(r.healthy for r in recs) and not ({(t.url, t.pid) for t in engine_targets(recs)} & was):
                return
            time.sleep(1.0)
        raise TimeoutError(f"the engines were not all up again within {self.timeout_s:g} s")

    def _rank0(self, what: str, fn) -> None:
        """Rank 0 runs `fn`; every rank learns whether it worked (and fails the step if not)."""
        err = [None, False]
        if self.rank == 0:
            try:
                fn()
            except Exception as e:  # an engine that did not answer: fail the step, SLURM requeues
                err = [f"{type(e).__name__}: {e}", bool(self.ending())]
        dist.broadcast_object_list(err, src=0)
        if err[0] is not None:
            raise (EnginesGone if err[1] else RuntimeError)(f"colocate: {what} failed: {err[0]}")

    def watch_growth(self, setting: str, margin: int, attempt: int) -> None:
        """Under auto (`setting`), with the engines about to size their share on what the trainer holds now:
        from now on each turn's end re-checks that it holds no more than that plus `margin` beside them
        (offload_choice.py `recheck`), and moves more where it does. The user's flag is left as it is."""
        if self.cuda and setting == "auto":
            self._room = torch.cuda.memory_reserved(self.params.device) + margin
            self._attempt = attempt

    def _recheck(self) -> None:
        """Collective: at the turn's end, the moving sets off the GPU but the params (the publish reads
        them), before the engines resume. The record and the log say what changed."""
        if self._room is None:
            return
        held = torch.cuda.memory_reserved(self.params.device)
        if "params" in self.moves:
            held -= self.params.nbytes  # they leave before the engines' cache is back (`to_engines`)
        self.times["mem/trainer_held_gib"] = held / 2**30
        self.times["mem/trainer_room_gib"] = self._room / 2**30
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, (held, self._room, {s: self.sets[s].device_nbytes for s in SETS}))
        moves, keep, line = recheck(self.moves, self.rest.keep, every)
        if line and self.rank == 0:
            log.warning("colocate: offload-train auto, re-checked: %s", line)
        if moves == self.moves and keep == self.rest.keep:
            return
        self.moves, self.rest.keep = moves, keep
        # the params leave after the publish (`to_engines`); a rest that moved already sheds what no longer stays
        self._move(offload=tuple(self.sets[s] for s in moves if s != "params"))
        if self.rank == 0:
            self._record_recheck(line)

    def _record_recheck(self, line: str) -> None:
        rec = self.control.colocation_memory(self._attempt)
        if rec is None or rec.offload is None:
            return
        off = rec.offload.model_copy(update={
            "moves": list(self.moves), "keeps": [s for s in SETS if s not in self.moves],
            "rest_kept_gib": round(self.rest.keep / 2**30, 3), "rechecks": [*rec.offload.rechecks, line]})
        self.control.write_colocation_memory(rec.model_copy(update={"offload": off, "updated_at": time.time()}))

    def offload_all(self) -> None:
        """At start-up, before the engines start (`let_engines_start`)."""
        self._move(offload=(self.rest, self.grads, self.params))

        def fate(s: str) -> str:
            if s not in self.moves:
                return "stay"
            if s == "rest" and self.rest.keep:  # partly: what fits beside the engines stays
                return (f"move but {self.rest.device_nbytes / 2**30:.2f} GiB (up to {self.rest.keep / 2**30:.2f} "
                        "GiB with the moments the first step makes)")
            return "move"
        log.info("colocate: %s", "; ".join(
            f"{self.sets[s].nbytes / 2**30:.2f} GiB of {what} {fate(s)}"
            for s, what in (("params", "params"), ("grads", "gradients (dropped, not copied)"),
                            ("rest", f"other trainer state ({LABELS['rest']}, ref, critic)"))))

    def to_trainer(self, version: int) -> None:
        """Rollout `version - 1` is committed: the engines give their memory up, the trainer takes it."""
        t0 = time.perf_counter()

        def release() -> None:
            for attempt in range(1, RELEASE_TRIES + 1):
                self._keeper = _BracketKeeper(self.control, version, self.timeout_s)
                self._released = set()
                try:
                    paused = self._engines("pause_generation", mode="abort")
                    self._released = {(t.url, t.pid) for t in paused}
                    self._engines("release_memory_occupation", released_only=True, tags=None)
                    return
                except EnginesLost as e:
                    if self.ending() or attempt == RELEASE_TRIES:
                        raise
                    log.warning("colocate: release %d of %d: %s; putting back the engines released, waiting for "
                                "all to be up again", attempt, RELEASE_TRIES, e)
                    self._released -= {(t.url, t.pid) for t in e.gone}
                    self._put_back()
                    self._wait_for_restart(e.gone)
        self._rank0("releasing the engines' memory", release)
        t1 = time.perf_counter()
        self.times = {"time/engines_release": t1 - t0}
        self._gpu_used("released")
        # the optimizer state comes back beside the first forward/backward: the first optimizer step waits
        # for it (`finish_onload`, trainer/step.py), and time/onload_wait is what that did not hide
        self._move(onload=(self.params, self.grads, self.rest), defer_late=True)
        self.times["time/onload"] = time.perf_counter() - t1
        self.times["time/onload_wait"] = 0.0
        self._gpu_used("onloaded")
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.params.device)

    def _put_back(self) -> None:
        """Rank 0, in the release: the engines this turn released serve again (memory, then generation),
        and the bracket goes, so that their supervisors check and restart them again."""
        try:
            self._resume(tags=None)
            self._continue()
        finally:
            self._released = set()
            if self._keeper is not None:
                self._keeper.stop()
                self._keeper = None

    def _continue(self) -> None:
        """Rank 0: every engine generates again; one gone since is left out (its record is current
        only once it is back)."""
        try:
            self._engines("continue_generation")
        except EnginesLost as e:
            log.warning("colocate: %s; the others continue", e)

    def _resume(self, *, tags: list[str] | None) -> None:
        """Rank 0: the engines this turn released get `tags` back; one gone since is left out."""
        try:
            self._engines("resume_memory_occupation", released_only=True, tags=tags)
        except EnginesLost as e:
            log.warning("colocate: %s; left out (restarted after the turn, it gets the next publish)", e)
            self._released -= {(t.url, t.pid) for t in e.gone}

    def to_engines_for_weights(self) -> None:
        """Trained (and saved): keep the params for the export, give the rest back; engines reload weights."""
        t0 = time.perf_counter()
        if self.cuda:
            self.times["mem/trainer_peak_reserved_gib"] = torch.cuda.max_memory_reserved(self.params.device) / 2**30
        # Adam's moments are made at the optimizer's first step, after the sets were taken: left
        # behind, they would hold GPU memory through every generation (bench/results/colocate-h100.md).
        # Added to a set that stays too: its bytes are what it keeps on the GPU (mem/trainer_resident_gib).
        added = {"rest": self.rest.add(other_tensors(self.st), exclude=(self.params, self.grads),
                                       late=optimizer_state(self.st)),
                 "grads": self.grads.add(grad_tensors(self.st), exclude=(self.params, self.rest))}
        new = sum(n for s, n in added.items() if s in self.moves)
        if new:
            log.info("colocate: %.2f GiB of trainer state made since the last move now moves too%s", new / 2**30,
                     f" (but what fits in the {self.rest.keep / 2**30:.2f} GiB of the rest that stay)"
                     if "rest" in self.moves and self.rest.keep else "")
        self._move(offload=(self.rest, self.grads))
        self._recheck()
        t1 = time.perf_counter()
        self._rank0("resuming the engines' weights", lambda: self._resume(tags=[WEIGHTS]))
        self.times.update({"time/offload": t1 - t0, "time/engines_resume": time.perf_counter() - t1})
        self._gpu_used("engine_weights")

    def to_engines(self) -> None:
        """Published: the params go too; the engines get their cache back and generate again."""
        t0 = time.perf_counter()
        self._move(offload=(self.params,))
        t1 = time.perf_counter()

        def resume() -> None:
            try:
                self._resume(tags=[KV_CACHE, CUDA_GRAPH])
                self._continue()  # every engine: the publish left each one paused
            finally:
                if self._keeper is not None:
                    self._keeper.stop()
                    self._keeper = None
        self._rank0("resuming the engines' cache", resume)
        self.times["time/offload"] = self.times.get("time/offload", 0.0) + t1 - t0
        self.times["time/engines_resume"] = self.times.get("time/engines_resume", 0.0) + time.perf_counter() - t1
        self._gpu_used("engines_resumed")
        if self.cuda:  # what stayed beside the engines (trainer/offload_choice.py)
            self.times["mem/trainer_resident_gib"] = sum(self.sets[s].device_nbytes for s in SETS) / 2**30

    def release_for_save(self) -> None:
        """The job or the run ends (a preempt, TERM or stop; the last rollout trained) and the trainer must
        onload everything to save: between rollouts, or after an engine phase of the turn failed as the
        engines went down. Every engine still answering gives its memory up first, and a turn record is
        kept until the trainer exits (no restart takes memory during the save; engines/turn_watch.py).
        Best effort, bounded by SAVE_RELEASE_S per call: an engine that does not answer is going or gone
        with the job; one already released may refuse a second release (logged). Collective; never raises."""
        if self.rank == 0:
            log.info("colocate: the engines give their memory up for a save outside the turn")
            if self._keeper is None:
                self._keeper = _BracketKeeper(self.control, -1, self.timeout_s)
            timeout_s, self.timeout_s = self.timeout_s, min(self.timeout_s, SAVE_RELEASE_S)
            try:
                for method, kw in (("pause_generation", {"mode": "abort"}),
                                   ("release_memory_occupation", {"tags": None})):
                    try:
                        self._engines(method, **kw)
                    except Exception as e:  # going down with the job: nothing to give back
                        log.warning("colocate: before the job's last save, %s: %s: %s", method, type(e).__name__, e)
            finally:
                self.timeout_s = timeout_s
        dist.barrier()

    def _gpu_used(self, phase: str) -> None:
        """Memory in use on this rank's GPU by every process (the engines' included), after `phase`."""
        if self.cuda:
            free, total = torch.cuda.mem_get_info(self.params.device)
            self.times[f"mem/gpu_used_gib/{phase}"] = (total - free) / 2**30

    @contextmanager
    def holding(self, *, params_only: bool = False) -> Iterator[None]:
        """The trainer's tensors on the GPU for a while, outside the phases: a checkpoint (a stop or
        preempt between rollouts), --save-hf, a publish again to a restarted engine."""
        sets = (self.params,) if params_only else (self.params, self.grads, self.rest)
        moved = tuple(s for s in sets if s.offloaded)
        self._move(onload=moved)
        try:
            yield
        finally:
            self._move(offload=moved)

    def finish_onload(self) -> None:
        """Until the optimizer state's copy back (`to_trainer`) is done; what the host waited is added to
        time/onload_wait. Before an optimizer step, a save, and any other move."""
        if self._late is None:
            return
        t0 = time.perf_counter()
        self._late.wait()
        self._late = None
        self.times["time/onload_wait"] = self.times.get("time/onload_wait", 0.0) + time.perf_counter() - t0

    def _move(self, *, offload: tuple[TensorSet, ...] = (), onload: tuple[TensorSet, ...] = (),
              defer_late: bool = False) -> None:
        """The moves of those of the sets that move (`moves`); after an offload the cache goes back to the
        driver either way: the activations' blocks the trainer freed are the engines' room. `defer_late`:
        the storages marked late are copied back beside what follows (`finish_onload`)."""
        self.finish_onload()
        for s in onload:
            if any(s is m for m in self._moving):
                late = s.onload(defer_late=defer_late)
                if late is not None:
                    self._late = late
        for s in offload:
            if any(s is m for m in self._moving):
                s.offload()
        if self.cuda:
            # this stream only: a LateCopy's own stream goes on beside what follows
            torch.cuda.current_stream(self.params.device).synchronize()
            if offload:
                torch.cuda.empty_cache()  # back to the driver: the engines are another process

    def close(self) -> None:
        if self._keeper is not None:
            self._keeper.stop()


class _BracketKeeper:
    """Rank 0 renews control/weight_update.json while the engines are released, so the rollout nodes
    keep their health checks paused for as long as the trainer trains (engines/update_watch.py caps
    one record's hold at the sync timeout; a renewed record is honoured again). It also keeps
    control/colocate_turn.json, the turn itself: the publish inside the turn opens and clears the
    weight-update bracket of its own, the turn record stays until the last resume. While it is there
    the rollout nodes restart an engine that died only after the turn (engines/turn_watch.py): a
    restart at once would take GPU memory the trainer uses (the engine or the trainer OOMs)."""

    def __init__(self, control: Any, version: int, timeout_s: float):
        self.control, self.version, self.timeout_s = control, version, timeout_s
        self.since = time.time()
        self.control.mark_turn(version, timeout_s, self.since)
        self.control.mark_weight_update(version, timeout_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="colocate-bracket", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(min(10.0, self.timeout_s / 3)):
            self.control.mark_turn(self.version, self.timeout_s, self.since)
            self.control.mark_weight_update(self.version, self.timeout_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.control.clear_weight_update()
        self.control.clear_turn()
        log.info("colocate: the turn of v%d is over after %.2f s", self.version, time.time() - self.since)
