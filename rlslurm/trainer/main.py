"""Het-group 0 entry point, run by torchrun on every trainer rank:
`torchrun ... -m rlslurm.trainer.main --run-dir RUN`.

Start-up: read RUN/run.yaml, record this rank's placement, join torch.distributed (NCCL on GPUs,
gloo on CPU) and check the world matches the config. Then, read top to bottom in `Trainer.run`:
build the models, resume from the newest intact checkpoint, and for each rollout N
wait for it -> recompute log-probs, advantages -> `num_steps_per_rollout` optimizer steps ->
metrics -> publish weights version N+1 -> checkpoint every `save_interval` rollouts. After a
resume, rollouts already in the buffer are trained while this attempt's engines start; the newest
version is published to them as soon as they are up (the driver waits for the version it needs).
An engine restarted mid-run is kept out of the router until it has the published weights; while
waiting for a rollout the trainer publishes the same version again to bring it back.
A preempt request (control/preempt.json from the batch shell, or SIGTERM to this process)
checkpoints, acknowledges and exits 0; a stop request exits 0; once `num_rollout` rollouts are
trained, or the driver recorded that the prompt data ran out before the next one, the run is
marked FINISHED.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from rlslurm import role_log
from rlslurm.buffer.control import Control
from rlslurm.buffer.progress import TrainerProgress, after_checkpoint
from rlslurm.buffer.reader import BufferTimeout, RolloutReader
from rlslurm.buffer.rundir import RunDir
from rlslurm.errors import DataError, UserError
from rlslurm.gpus import torch_device_uuid
from rlslurm.heartbeat import Beat, keeps_heartbeat
from rlslurm.job.env import job_env
from rlslurm.job.report import write_env_report
from rlslurm.settings.config import RunConfig
from rlslurm.settings.runfile import load_run_config
from rlslurm.settings.weight_plan import weight_sync_plan
from rlslurm.stacks import check_run_role
from rlslurm.trainer.collectives import collective_device, from_rank0
from rlslurm.trainer.colocate import EnginesGone, let_engines_start
from rlslurm.trainer.commands import POLL_S, Command, Failed, Next
from rlslurm.trainer.replay_subsample import subsample
from rlslurm.trainer.rollout_only import watch
from rlslurm.trainer.setup import init_distributed
from rlslurm.trainer.turns import ColocatedTurn, PlainTurn
from rlslurm.trainer.weights.base import SyncInterrupted
from rlslurm.trainer.weights.delivery import Publish, WeightDelivery

log = logging.getLogger("rlslurm.trainer")

# While the trainer waits, rank 0 looks for a later attempt of the run (a listing of logs/ and a read
# of the ledger) this often, not at every poll (docs/shared-fs-load.md): a trainer that outlived its
# attempt writes nothing meanwhile, every trained rollout is checked before its publish and checkpoint.
SUPERSEDED_POLL_S = 10.0

# SLURM ends a job (scancel, scontrol requeue, preemption, the time limit) by TERMing every process
# and KILLing it KillWait (or the partition's GraceTime) later. Dying at once on TERM would lose
# everything since the last --save-interval; instead a TERM is a preempt request: finish the step
# in progress, checkpoint, ack. Requeueing is SLURM's business (PreemptMode=REQUEUE, scontrol
# requeue); after a scancel the checkpoint lets `rlslurm resubmit` continue.
_term_at: float | None = None


def _on_term(signum: int, frame: object) -> None:
    global _term_at
    if _term_at is None:
        _term_at = time.time()
    # Ignored (unlike handled) signals stay ignored across fork and exec: megatron's checkpoint writer
    # spawns helper processes during the save, and a later TERM to the step (torchrun forwards the
    # TERM it got; slurmstepd signals every process) must not kill them mid-save.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def term_received() -> bool:
    return _term_at is not None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlslurm.trainer.main")
    p.add_argument("--run-dir", type=Path, required=True)
    a = p.parse_args(argv)
    signal.signal(signal.SIGTERM, _on_term)
    cfg = load_run_config(a.run_dir)
    check_run_role("trainer", cfg)  # before any collective: every rank refuses alike (rlslurm/stacks.py)
    rd = RunDir(a.run_dir)
    rank, world = init_distributed(cfg.run.device, cfg.train.distributed_timeout_minutes)
    role_log.configure(f"[trainer {rank}] %(asctime)s %(levelname)s %(message)s")
    write_env_report(rd.path, "trainer", rank, {
        "world_size": world,
        # the GPU this rank really uses, from the driver: which GPU each process used (docs/gpu.md, "Which GPU")
        "gpu_uuid": torch_device_uuid(torch.cuda.current_device()) if cfg.run.device == "cuda" else None,
        "master_addr": os.environ.get("MASTER_ADDR"),
        "master_port": os.environ.get("MASTER_PORT"),
        "run_name": cfg.run.run_name,
        "sglang_args": cfg.sglang_args,
        "prompt_data": str(cfg.data.prompt_data) if cfg.data.prompt_data else None,
        "user_env": {k: os.environ.get(k) for k in cfg.slurm.env},
        "secret_env_set": [k for k in cfg.slurm.secret_env if k in os.environ],  # names only: the file is 0640
    })
    expected = (cfg.slurm.trainer_nodes or 1) * cfg.trainer_procs_per_node
    if world != expected:
        raise UserError(f"trainer world size {world} != --trainer-nodes x procs per node = {expected}")
    # Every rank proves the collective path works before any real work.
    t = torch.ones(1, device=collective_device())
    dist.all_reduce(t)
    assert int(t.item()) == world

    if cfg.rollout.num_rollout == 0 or rd.is_finished():
        # Nothing to train: do not pay for building a model.
        if rank == 0 and not rd.is_finished():
            rd.mark_finished({"trained_rollouts": 0, "at": time.time()})
        status = 0
    elif cfg.train.debug_rollout_only:
        status = watch(cfg, rd, rank, term_received)
    else:
        status = Trainer(cfg, rd, rank, world).run()
    dist.barrier()
    dist.destroy_process_group()
    return status


class Trainer:
    def __init__(self, cfg: RunConfig, rd: RunDir, rank: int, world: int):
        self.cfg, self.rd, self.rank, self.world = cfg, rd, rank, world
        self.control = Control(rd)
        self.replay = cfg.train.load_debug_rollout_data is not None
        # no engines at all: a replay, or --debug-train-only's engine-free rollouts (SFT)
        self.no_engines = cfg.starts_no_engines
        self.last_saved: int | None = None
        self.attempt = job_env().attempt
        self.ended_early: str | None = None  # rank 0: why the run ends before --num-rollout
        self._superseded_next = 0.0  # rank 0's poll: when to look for a later attempt again (monotonic)
        self._heartbeat = Beat(lambda: self.control.heartbeat(
            "trainer", self.rank, phase=self._phase_text, phase_since=self._phase_since), on=keeps_heartbeat(rank))
        self._phase_text: str | None = None   # rank 0: what it does now, in its heartbeat
        self._phase_since = time.time()
        self.pin_host = True  # page-lock the checkpoint staging area (`_may_page_lock`)
        self.host_room: tuple[int | None, str] | None = None  # host memory available at the start, and whence
        self.host_locked = 0  # bytes this rank page-locks for its staging area
        self.plan = weight_sync_plan(cfg)  # every weight-sync setting, resolved once (rlslurm/settings/weight_plan.py)
        self.delivery = WeightDelivery(self.control, self.plan, rank=rank, no_engines=self.no_engines,
                                       note=self._phase, ending=self.attempt_ending)
        self.turn: PlainTurn | ColocatedTurn = PlainTurn(self)  # --colocate's once the model is built

    # ------------------------------------------------------------------ the loop

    def run(self) -> int:
        from rlslurm.trainer import checkpoint
        from rlslurm.trainer.build_errors import final_if_deterministic
        from rlslurm.trainer.metrics import MetricsLogger
        from rlslurm.trainer.setup import build_trainer
        from rlslurm.trainer.weights.factory import publisher_for

        cfg, rd = self.cfg, self.rd
        self._phase("building the model")
        # a deterministic failure here ends the job once, as a user error (trainer/build_errors.py)
        with final_if_deterministic(f"building {cfg.model.model} and loading its weights"):
            self.st = st = build_trainer(cfg, self.world)
        from rlslurm.models.specs import built_layers

        log.info("models built, --transformer-impl %s (%s); resuming from the latest checkpoint if any",
                 cfg.train.transformer_impl, built_layers(st.actor.model))
        with final_if_deterministic(f"loading the checkpoint of {rd.checkpoints_dir}"):
            progress, ckpt = checkpoint.resume(st, rd.checkpoints_dir)
        self.progress = progress  # the same object the loop advances
        if ckpt is not None:
            self.last_saved = progress.trained_rollouts
            log.info("resumed from %s: next rollout %d, weight version %d", ckpt, progress.next_rollout_id,
                     progress.weight_version)
        self.pin_host = self._may_page_lock()
        self._checkpointer().prepare(st, pin=self.pin_host)  # while the engines come up and the first rollout is made
        self.reader = self._reader()
        self.delivery.start(publisher_for(self.plan, st, self.control, hf_dir=cfg.model.hf_checkpoint,
                                          replay=self.replay, no_engines=self.no_engines,
                                          ending=self.attempt_ending, note=self._phase), st)
        if ckpt is not None and progress.weight_version > 0:
            # Engines restarted with the job start from the HF weights and need the trained ones. Do
            # not wait for them here: after a hard requeue the next rollouts are often already in the
            # buffer, so train those while the engines start and publish once they are up.
            self.delivery.defer(progress.weight_version)
        self.metrics = MetricsLogger(rd.metrics, rd.tb_dir, enabled=self.rank == 0, attempt=self.attempt,
                                     cfg=cfg)
        try:
            try:
                if cfg.run.colocate:  # the engines and the trainer take turns on the GPUs (trainer/turns.py)
                    self.turn = ColocatedTurn.start(self)
                elif cfg.run.shared_gpu:  # both on the same GPU at once: the engines start beside the model
                    let_engines_start(self.st, self.control, attempt=self.attempt, rank=self.rank,
                                      bucket_bytes=self.plan.bucket_bytes, trains_beside=True)
                ended = self._loop(progress)
            except SyncInterrupted as e:  # a sync in flight when the job began to end
                ended = self._ending(progress, e)
            if ended is not None:
                return ended
            if self.rank == 0:
                self._mark_finished(progress)
            return 0
        finally:
            self.metrics.close()
            self.turn.close()
            self.delivery.close()

    def _may_page_lock(self) -> bool:
        """Whether this node's host memory holds the checkpoint staging areas its ranks would page-lock
        (trainer/host_memory.py; --colocate's copies are checked once what moves is known, trainer/turns.py);
        else they stay pageable, said in one line."""
        from rlslurm.trainer import host_memory
        from rlslurm.trainer.checkpoint import staging_estimate

        if self.cfg.run.device != "cuda":
            return True  # nothing is page-locked on CPU
        # measured once, before the staging area is reserved: --colocate's copies are checked against the
        # same figure once the trainer knows what moves (trainer/turns.py)
        self.host_room = host_memory.available()
        staging = staging_estimate(self.st)
        ok, line = host_memory.may_page_lock(staging, host_memory.local_ranks(), False, self.host_room)
        self.host_locked = staging if ok else 0
        if line is not None:
            log.warning("%s", line)
        return ok

    def _mark_finished(self, progress: TrainerProgress) -> None:
        ended_early = {} if self.ended_early is None else {"ended_early": self.ended_early}
        self.rd.mark_finished({"trained_rollouts": progress.trained_rollouts,
                               "weight_version": progress.weight_version, "at": time.time(), **ended_early})
        if self.ended_early is not None:
            log.warning("run FINISHED after %d rollouts: %s", progress.trained_rollouts, self.ended_early)

    def _loop(self, progress: TrainerProgress) -> int | None:
        """Train every rollout of the run; an exit status if the attempt ends before (preempt, stop,
        superseded), None once the run is complete."""
        cfg = self.cfg
        while progress.next_rollout_id < cfg.rollout.num_rollout:
            self._beat()
            t0 = time.perf_counter()
            self._phase(f"waiting for rollout {progress.next_rollout_id}")
            cmd = self._next_command(progress.next_rollout_id)
            if cmd is Next.PREEMPT:
                return self._preempt(progress)
            if cmd is Next.STOP:
                return self._stop(progress)
            if cmd is Next.END:
                break
            if cmd is Next.SUPERSEDED:
                return self._superseded_exit()
            rollout = self._read_rollout(progress.next_rollout_id)
            if self.replay and cfg.train.load_debug_rollout_data_subsample is not None:
                rollout = subsample(rollout, cfg.train.load_debug_rollout_data_subsample)
            try:
                self.turn.begin(rollout.rollout_id)  # --colocate: the engines give the GPUs to the trainer
            except EnginesGone as e:
                return self._ending(progress, e)
            self._phase(f"training rollout {rollout.rollout_id}")
            lines = self._train_rollout(rollout, time.perf_counter() - t0)
            if self._superseded_collective():  # no publish or checkpoint from a lost attempt
                return self._superseded_exit()
            progress.record_trained(rollout, weight_version=rollout.rollout_id + 1)
            try:
                times = self.turn.after_training(progress)  # publish and checkpoint, if due
            except (EnginesGone, SyncInterrupted) as e:
                self._log_lines(lines)  # trained: its metrics stay with it, also when the engines are gone
                return self._ending(progress, e)
            self._log_lines(lines, {**times, "time/iteration": time.perf_counter() - t0})
        if self.delivery.pending is not None:  # the engines never came up while we trained
            self.delivery.wait_for_engines()
            self.delivery.publish(self.delivery.pending)
        self._saved(self._checkpointer().wait())  # a save in flight may be of this very progress
        if self.last_saved != progress.trained_rollouts:
            # outside the turn the save onloads the whole trainer: beside the engines' weights and cache it
            # did not fit (qwen3-4B on one H100, bench/results/gpu-lease-2026-12-07f.md); they are done
            self.turn.release_for_save()
            self.save(progress)
            self._save_hf(progress)
        return None

    def _log_lines(self, lines: list[tuple[int, dict]], times: dict[str, float] | None = None) -> None:
        """A trained rollout's metrics lines, with its phases' `times` and the publishes since the last
        rollout (trainer/weights/delivery.py `metrics`), if it got that far."""
        if times is not None:
            sync = self.delivery.metrics()
            for _, values in lines:  # rollout-level phases, repeated on each of its steps
                values.update(times)
                values.update({k: v for k, v in sync.items() if k != "weight_sync/deliveries"})
            if "weight_sync/deliveries" in sync and lines:  # each publish once, on the rollout's first step
                lines[0][1]["weight_sync/deliveries"] = sync["weight_sync/deliveries"]
        for step, values in lines:
            self.metrics.log(step, values)

    def save_if_due(self, progress: TrainerProgress) -> None:
        self._saved(self._checkpointer().poll())  # the save in flight, if it has become `latest` meanwhile
        si = self.cfg.train.save_interval
        if si is not None and progress.trained_rollouts % si == 0:
            self.save(progress, wait=False)  # trains on while it is written (trainer/checkpoint/writer.py)
            self._save_hf(progress)

    def _train_rollout(self, rollout, wait_s: float) -> list[tuple[int, dict]]:
        from rlslurm.trainer import step as steps
        from rlslurm.trainer.advantages import reward_from

        st, t = self.st, self.cfg.train
        steps.check_rollout(rollout, st.vocab_size, st.mc.arch.max_position_embeddings)
        prep = steps.prepare(st, rollout)
        if t.save_debug_train_data:
            self._save_train_data(rollout.rollout_id, prep)
        key = self.cfg.rollout.reward_key
        raw = [reward_from(s.reward, s.reward_key or key, f"rollout {rollout.rollout_id} sample {i}")
               for i, s in enumerate(rollout.samples)]
        data = steps.rollout_metrics(rollout, raw)
        lines = []
        for k in range(t.num_steps_per_rollout):
            m = steps.train_step(st, rollout, prep, k)
            values = {"rollout_id": rollout.rollout_id, **m, **data, "time/wait_rollout": wait_s,
                      **{f"time/{n}": v for n, v in prep.times.items()}}
            lines.append((rollout.rollout_id * t.num_steps_per_rollout + k, values))
        return lines

    def _save_train_data(self, rollout_id: int, prep) -> None:
        """--save-debug-train-data: this rank's samples of the rollout as the loss sees them (each
        rank writes its own file; the buffer holds the tokens)."""
        path = Path(self.cfg.train.save_debug_train_data.format(rollout_id=rollout_id, rank=self.rank))
        path.parent.mkdir(parents=True, exist_ok=True)

        def cpu(d):
            return None if d is None else {i: x.detach().cpu() for i, x in d.items()}

        data = {"rollout_id": rollout_id, "rank": self.rank, "samples": sorted(prep.masks),
                "loss_masks": cpu(prep.masks), "advantages": cpu(prep.advantages), "returns": cpu(prep.returns),
                "old_logprobs": cpu(prep.old_logprobs), "ref_logprobs": cpu(prep.ref_logprobs),
                "rollout_logprobs": cpu(prep.rollout_logprobs), "values": cpu(prep.values)}
        tmp = path.with_name(f".{path.name}.tmp")
        torch.save(data, tmp)
        os.replace(tmp, path)

    # ------------------------------------------------------------------ coordination

    def _reader(self) -> RolloutReader:
        src = self.cfg.train.load_debug_rollout_data
        if src is not None:
            return RolloutReader.replay(src)
        # One rank owns the buffer's side effects (quarantine); the others only read.
        return RolloutReader(self.rd, readonly=self.rank != 0)

    def _read_rollout(self, rollout_id: int):
        """Collective: rank 0 reads the rollout (verified: rlslurm/buffer/reader.py) and every rank
        gets it by a broadcast, not by opening its manifest and data file on the shared run directory
        itself: per rank that was 2 metadata operations per rollout on every GPU of the job
        (docs/shared-fs-load.md). Ranks > 0 hold copies (writable), rank 0 the read-only views."""
        return self.from_rank0(lambda: self.reader.read(rollout_id))

    def from_rank0(self, fn):
        """Rank 0's `fn()` on every rank, its errors too (trainer/collectives.py `from_rank0`)."""
        return from_rank0(self.rank, self.world, fn)

    def ending_collective(self) -> bool:
        """Rank 0's `attempt_ending`, learnt by every rank at the same call."""
        return bool(self.from_rank0(self.attempt_ending))

    def attempt_ending(self) -> bool:
        return term_received() or self.control.preempt_requested() is not None or \
            self.control.stop_requested() is not None

    def publish_due(self, progress: TrainerProgress) -> bool:
        last = progress.trained_rollouts == self.cfg.rollout.num_rollout
        return last or progress.trained_rollouts % self.cfg.rollout.update_weights_interval == 0

    def _next_command(self, rollout_id: int) -> Next:
        """Collective: rank 0 polls the control files and the buffer, every rank gets its verdict
        (trainer/commands.py); publishes due meanwhile (trainer/weights/delivery.py) are made here."""
        while True:
            cmd: Command = self.from_rank0(lambda: self._poll(rollout_id))
            if isinstance(cmd, Failed):
                raise DataError(str(self.reader.dir), cmd.message)
            if isinstance(cmd, Publish):
                with self.turn.holding(params_only=True):
                    self.delivery.publish(cmd.version)
                continue
            if cmd is not Next.WAIT:
                return cmd

    def _beat(self, *, now: bool = False) -> None:
        """This node's heartbeat (control/heartbeats/trainer-<rank>.json; local rank 0 only:
        rlslurm/heartbeat.py), read by the attempt's watchdog (rlslurm/watchdog.py): written while
        waiting for rollouts and once per trained rollout, and by rank 0 at each change of phase
        (`rlslurm status` says what it does, and for how long)."""
        self._heartbeat(now=now)

    def _phase(self, text: str) -> None:
        """Rank 0: what the trainer does from now on ("weight sync v3 (nccl): try 2/2"), recorded at once."""
        if self.rank != 0 or text == self._phase_text:
            return
        self._phase_text, self._phase_since = text, time.time()
        self._beat(now=True)

    def _poll(self, rollout_id: int) -> Command:
        """Rank 0's verdict: a stop or preempt first, then a publish due, then the rollout; a WAIT after
        POLL_S. What a poll costs the shared run directory (docs/shared-fs-load.md): one listing of
        control/ for every record read from it, one listing of the buffer, a look for a later attempt
        every SUPERSEDED_POLL_S."""
        seen = self.control.listing()
        requests = self.control.requests(seen)
        if requests.preempt is not None or term_received():
            return Next.PREEMPT
        if requests.stop is not None:
            return Next.STOP
        if time.monotonic() >= self._superseded_next:
            self._superseded_next = time.monotonic() + SUPERSEDED_POLL_S
            if self._superseded():
                return Next.SUPERSEDED
        self._beat()
        if (due := self.delivery.due(self.progress.weight_version, seen)) is not None:
            return due
        if self.replay:
            if rollout_id not in self.reader.committed_ids():
                return Failed(f"replay buffer has no rollout {rollout_id} (--num-rollout "
                              f"{self.cfg.rollout.num_rollout}, committed: {self.reader.committed_ids()[-5:]})")
            return Next.READY
        try:
            self.reader.wait_for(rollout_id, timeout=0)  # one listing; the wait is the sleep below
            return Next.READY
        except BufferTimeout:
            pass
        if (rec := self.control.data_exhausted(self.attempt, seen)) is not None and rec.rollout_id <= rollout_id:
            self.ended_early = rec.message
            return Next.END
        time.sleep(POLL_S)  # a rollout committed meanwhile is read at the next poll: within POLL_S
        return Next.WAIT

    def _superseded(self) -> bool:
        """Rank 0: has a later attempt started (buffer/attempts.py)? A trainer that outlived its
        attempt would otherwise train the new attempt's rollouts, publish into its engines and
        write checkpoints beside it."""
        from rlslurm.buffer.attempts import superseded

        return superseded(self.rd, self.attempt)

    def _superseded_collective(self) -> bool:
        return bool(self.from_rank0(self._superseded))

    def _superseded_exit(self) -> int:
        log.error("attempt %d was superseded by a later attempt of this run: exiting without a checkpoint, "
                  "publish or acknowledgement", self.attempt)
        return 1

    # ------------------------------------------------------------------ checkpoints

    def save(self, progress: TrainerProgress, *, wait: bool = True) -> None:
        """Checkpoint `progress` (collective). The state is staged at once; `wait`: return only once the
        checkpoint is complete and `latest` (a save of the same progress already in flight is waited
        for, not repeated); else it completes in the background (`save_if_due` reports it)."""
        ckpt = self._checkpointer()
        if ckpt.pending_iteration != progress.trained_rollouts:
            self._phase(f"saving the checkpoint of {progress.trained_rollouts} rollouts")
            with self.turn.holding():
                self._saved(ckpt.start(self.st, progress))
        if wait:
            self._phase(f"waiting for the checkpoint of {progress.trained_rollouts} rollouts to be written")
            self._saved(ckpt.wait())

    def _checkpointer(self):
        from rlslurm.trainer.checkpoint import Checkpointer

        if getattr(self, "_ckpt", None) is None:
            self._ckpt = Checkpointer(self.rd.checkpoints_dir, self.cfg.train.keep_checkpoints,
                                      asynchronous=self.cfg.train.async_save)
        return self._ckpt

    def _saved(self, saved) -> None:
        """A checkpoint is complete and `latest` (every rank learns it at the same call): what it holds
        is durable, so the buffer may retire the rollouts it trained (buffer/progress.py)."""
        from rlslurm.trainer import checkpoint

        if saved is None:
            return
        self.last_saved = saved.progress.trained_rollouts
        log.info("saved checkpoint %s (training stalled %.2f s, of which the copy %.2f s to %s host memory; "
                 "latest after %.2f s)", saved.path, saved.stall_s, saved.stage_s, saved.staging, saved.total_s)
        if self.rank == 0 and not self.replay:
            after_checkpoint(self.reader, saved.progress,
                             checkpoint.retention(self.rd.checkpoints_dir, self.cfg.rollout.keep_trained_rollouts,
                                                  self.cfg.rollout.export_retired_rollouts))

    def _save_hf(self, progress: TrainerProgress) -> None:
        """--save-hf: the weights in HF format, as slime writes them with each save (not on a preempt or
        stop, whose checkpoint races SLURM's KILL)."""
        pattern = self.cfg.train.save_hf
        if not pattern or progress.trained_rollouts == 0:
            return
        from rlslurm.trainer.weights.disk import export_hf

        target = Path(pattern.format(rollout_id=progress.next_rollout_id - 1))
        st = self.st
        with self.turn.holding(params_only=True):
            export_hf(st.mc, st.actor.model, target, hf_dir=self.cfg.model.hf_checkpoint, dtype=st.tcfg.params_dtype)
        log.info("--save-hf: wrote %s", target)

    def _save_newest(self, progress: TrainerProgress) -> None:
        """Before a stop or preempt ack: the save in flight finished, then the newest trained state
        saved too if it is newer, so that the ack means "the newest state is `latest`"."""
        self._saved(self._checkpointer().wait())
        if progress.trained_rollouts > 0 and self.last_saved != progress.trained_rollouts:
            self.turn.release_for_save()  # --colocate: the engines give their memory up first
            self.save(progress)

    def _stop(self, progress: TrainerProgress) -> int:
        """A user stop: keep what was trained (a later `rlslurm resubmit` resumes from it), then let the
        rollout group go — it keeps the engines until this ack, so no sync in flight loses its peers."""
        self._save_newest(progress)
        if self.rank == 0:
            self.control.ack_stop(checkpoint_iteration=self.last_saved if self.last_saved is not None else -1)
        log.info("stop requested: saved, exiting before rollout %d", progress.next_rollout_id)
        return 0

    def _ending(self, progress: TrainerProgress, e: Exception) -> int:
        """The job ends while the engines are being called: a weight sync in flight was given up
        (`SyncInterrupted`), or --colocate's turn lost its engines as they went down with the TERM
        (`EnginesGone`). Keep what was trained, as a stop or preempt between rollouts would; the next
        attempt publishes the checkpoint's version."""
        log.warning("%s while the job ends: checkpointing what was trained and exiting", e)
        return self._stop(progress) if self.control.stop_requested() is not None else self._preempt(progress)

    def _preempt(self, progress: TrainerProgress) -> int:
        if term_received():
            log.info("SIGTERM %.1fs ago: checkpointing before SLURM's KILL", time.time() - _term_at)
        self._save_newest(progress)
        if self.rank == 0:
            it = self.last_saved if self.last_saved is not None else -1
            self.control.ack_preempt(checkpoint_iteration=it)
            log.info("preempt: checkpoint %d acknowledged, exiting for requeue", it)
        return 0


if __name__ == "__main__":
    # A UserError ends the job without requeue (rlslurm/user_error.py).
    from rlslurm.exit_guard import skip_final_gc_at_exit
    from rlslurm.user_error import run_dir_arg, run_role

    skip_final_gc_at_exit()

    run_role("trainer", main, run_dir_arg)
