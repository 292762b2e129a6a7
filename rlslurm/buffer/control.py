"""Control plane: small JSON records in RUN/control/ shared by the two het groups.

Every record has exactly one writer (named below) and is replaced atomically, so a
reader sees the old or the new version, never a mix. Records:

    engines.json                 rollout driver   EnginesRecord
    span-<engine>.json           its node rank 0  SpanRecord (an engine spanning nodes: where its ranks meet,
                                                  rewritten at each start of rank 0; engines/span.py)
    span-<engine>-rank<r>.json   node rank r      SpanRankRecord (that rank's process, and its exit)
    router.json                  rollout driver   RouterRecord
    rendezvous-<attempt>.json    trainer rank 0   RendezvousRecord (created once per attempt, O_EXCL;
                                                  every attempt's start removes the earlier ones)
    weight_version.json          trainer rank 0   WeightVersionRecord
    weight_update.json           trainer leader   WeightUpdateRecord (the stage-0 leader, only while it writes
                                                  weights into the engines; engines/update_watch.py reads it)
    colocate_turn.json           trainer rank 0   TurnRecord (--colocate: while the trainer holds the GPUs;
                                                  engines/turn_watch.py holds engine restarts until it goes)
    colocate_memory.json         trainer rank 0   ColocationMemory (--colocate: the trainer moved off the GPUs
                                                  what it moves, and says what and why; the rollout nodes start
                                                  their engines only then)
    heartbeats/<role>-<rank>.json  that process   Heartbeat
    preempt.json                 batch script     {"reason", "requested_at", "job_id", "restart_count"}
    preempt_ack.json             trainer rank 0   PreemptAck (the batch trap waits for it, then requeues)
    stop.json                    anyone (CLI)     StopRequest (stays until `rlslurm resubmit`/`run` clears it)
    stop_ack.json                trainer rank 0   PreemptAck (checkpoint saved; the engines may go)
    data_exhausted.json          rollout driver   DataExhausted (the prompts ran out before --num-rollout: the
                                                  trainer ends the run after the rollouts before it)
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rlslurm.buffer.atomic import (
    REREAD_S,
    Cancel,
    CorruptRecord,
    dumps_json,
    ensure_dir,
    listdir_fresh,
    publish_exclusive,
    read_bytes_ino,
    set_aside,
    sleep_or_cancel,
    unlink_durable,
    write_json_atomic,
)
from rlslurm.buffer.rundir import RunDir
from rlslurm.buffer.store import as_rundir
from rlslurm.errors import DataError, UserError

log = logging.getLogger(__name__)


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EngineRecord(_Record):
    url: str
    node: str
    gpu_ids: list[int] = Field(default_factory=list)
    # the physical GPU (UUID, rlslurm/gpus.py) of each of gpu_ids on this node; [] where not known
    gpu_uuids: list[str] = Field(default_factory=list)
    pid: int | None = None
    healthy: bool = False
    restarts: int = 0
    awaiting_weights: bool = False  # restarted, not routed until it serves the published weights
    sglang_version: str | None = None  # its HTTP API (engines/sglang_versions.py); None: written before recorded
    # its TP ranks, on every node it spans (a weight-sync group gives each one a rank); None: len(gpu_ids)
    ranks: int | None = None
    # the node of each of its node ranks, rank 0's first, for an engine spanning nodes (engines/span.py);
    # [] for an engine of one node (`node`). TP rank j runs on nodes[j // len(gpu_ids)], GPU
    # gpu_ids[j % len(gpu_ids)] (SGLang's layout): where --colocate's IPC finds each rank's trainer.
    nodes: list[str] = Field(default_factory=list)


class EnginesRecord(_Record):
    engines: list[EngineRecord]
    updated_at: float = Field(default_factory=time.time)


class SpanRecord(_Record):
    """An engine spanning nodes as its node rank 0 last started it: the other ranks start (again)
    for every new generation of the attempt they run in (engines/span.py)."""
    engine: str
    attempt: int
    generation: int
    dist_init_addr: str
    nnodes: int
    updated_at: float = Field(default_factory=time.time)


class SpanRankRecord(_Record):
    """Node rank `node_rank` (> 0) of an engine spanning nodes: its process for `generation`, and
    its exit code once it exited (rank 0's supervisor then restarts the engine)."""
    engine: str
    attempt: int
    generation: int
    node_rank: int
    node: str
    pid: int | None = None
    exit_code: int | None = None
    error: str | None = None     # its process could not be started at all
    updated_at: float = Field(default_factory=time.time)


class RouterRecord(_Record):
    url: str
    updated_at: float = Field(default_factory=time.time)


class RendezvousRecord(_Record):
    master_addr: str
    master_port: int
    world_size: int
    group_name: str
    attempt: int


class WeightVersionRecord(_Record):
    version: int
    updated_at: float = Field(default_factory=time.time)
    # what delivered it (rlslurm/settings/weight_plan.py TRANSPORTS) and how many versions of this attempt the
    # fallback delivered so far; None: written by a trainer from before these were recorded
    transport: str | None = None
    fallbacks: int = 0
    last_fallback: str | None = None  # "v<N>: why", the newest version the fallback delivered


class WeightUpdateRecord(_Record):
    """The weight-update bracket: the engines are being written and may answer nothing until `until`."""
    state: Literal["updating"] = "updating"
    version: int
    until: float  # the trainer's wall clock (time.time()); readers bound it by their own clock too
    pid: int = Field(default_factory=os.getpid)


class OffloadRecord(_Record):
    """--colocate: which of the trainer's tensor sets leave the GPU while the engines generate, and why
    (trainer/offload_choice.py). `setting`: auto, --offload-train or --no-offload-train; `auto_keeps`:
    what auto keeps (None on CPU: no GPU memory to decide on); `terms_gib`: the rule's terms; `rechecks`:
    what auto moved since, and why (trainer/offload_choice.py `recheck`); `keeps`/`moves` and `rest_kept_gib` are
    the current ones."""
    setting: str
    keeps: list[str]
    moves: list[str]
    line: str
    terms_gib: dict[str, float] = Field(default_factory=dict)
    auto_keeps: list[str] | None = None
    rechecks: list[str] = Field(default_factory=list)
    rest_kept_gib: float = 0.0  # of the rest, which moves: what stays on the GPU (auto: what fits)


class ColocationMemory(_Record):
    """--colocate: this attempt's trainer has built its model and moved off the GPUs what it moves, so
    the engines may start and size themselves on what is free (engines/memory_share.py); `margins`: per
    GPU (its UUID; "" on CPU), what the trainer may take beside engines that hold their whole share;
    `offload`: what the trainer moves (None: --shared-gpu, nothing moves)."""
    attempt: int
    margins: dict[str, int]
    offload: OffloadRecord | None = None
    updated_at: float = Field(default_factory=time.time)


class TurnRecord(_Record):
    """--colocate: the trainer's turn on the GPUs, from the engines' release to their last resume
    (trainer/colocate.py). A rollout node restarts an engine that died in it only once it is over
    (engines/turn_watch.py): a new engine would take the memory the trainer is using."""
    version: int
    until: float  # the trainer's wall clock; renewed while the turn lasts, readers bound it by their own clock too
    since: float = Field(default_factory=time.time)
    pid: int = Field(default_factory=os.getpid)


class Heartbeat(_Record):
    role: str
    rank: int
    host: str = Field(default_factory=socket.gethostname)
    pid: int = Field(default_factory=os.getpid)
    time: float = Field(default_factory=time.time)
    # what the role is doing and since when (its wall clock): `rlslurm status` and `rlslurm run`
    # say why a run makes no progress ("weight sync v3: try 2/2", "starting engines")
    phase: str | None = None
    phase_since: float | None = None


class PreemptRequest(BaseModel):
    """preempt.json, written by the batch script's printf (or a test): any JSON object."""

    model_config = ConfigDict(extra="allow")


class PreemptAck(_Record):
    checkpoint_iteration: int
    acked_at: float = Field(default_factory=time.time)
    pid: int = Field(default_factory=os.getpid)


class DataExhausted(_Record):
    """The driver could not fill rollout `rollout_id`: no new rollout comes in this attempt."""
    rollout_id: int
    attempt: int  # a record of an earlier attempt is stale: the user may have given more data since
    message: str
    at: float = Field(default_factory=time.time)


class StopRequest(_Record):
    reason: str
    requested_at: float = Field(default_factory=time.time)


R = TypeVar("R", bound=_Record)


@dataclass(frozen=True)
class Requests:
    """`Control.requests()`: what one listing of control/ found (None: absent)."""
    stop: "StopRequest | None"
    stop_ack: "PreemptAck | None"
    preempt: "PreemptRequest | None"
    preempt_ack: "PreemptAck | None"


class Listing:
    """One listing of control/ (`Control.listing`), shared by every record a poller reads from it: each
    is opened only if listed, and not listed again (docs/shared-filesystem.md, "Stale directory caches":
    the listing is what makes an absent name trustworthy on NFS). Trainer rank 0's poll reads stop,
    preempt, engines.json and data_exhausted.json through one (docs/shared-fs-load.md)."""

    def __init__(self, directory: Path, *, readonly: bool = False):
        self.dir, self.readonly = directory, readonly
        self.names = frozenset(listdir_fresh(directory))

    def read(self, name: str, model: type["R"]) -> "R | None":
        return (read_record(self.dir / name, model, relist=False, readonly=self.readonly) if name in self.names
                else None)



def _parse(data: bytes, path: Path, model: type[R]) -> R:
    try:
        obj = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(str(path), f"not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise DataError(str(path), f"expected a JSON object, found {type(obj).__name__}")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise DataError(str(path),
                        f"not a valid {model.__name__}: {e.errors()[0]['msg']} at {e.errors()[0]['loc']}") from None


def read_record(path: Path, model: type[R], *, relist: bool = True, readonly: bool = False) -> R | None:
    """A control record, None if absent (`relist=False`: its directory was just listed by the caller).
    Every record is written atomically by the run itself, so one
    that reads as damaged twice was damaged on disk: it is set aside (buffer/atomic.py `set_aside`)
    and a CorruptRecord fails this attempt; the next attempt's writer rebuilds it
    (docs/shared-filesystem.md, "When the filesystem fails"). `readonly` (a reader that must not change
    the run: `rlslurm status`): a damaged record is left where it is, with a warning, and reads as None."""
    for last in (False, True):
        got = read_bytes_ino(path, relist=relist)
        if got is None:
            return None
        data, ino = got
        try:
            return _parse(data, path, model)
        except DataError as e:
            if not last:
                time.sleep(REREAD_S)
                continue
            if readonly:
                log.warning("%s: damaged on disk (%s); left as it is and read as absent", path, e.message)
                return None
            aside = set_aside(path, ino)
            if aside is None:  # replaced by its writer meanwhile: read that one
                return read_record(path, model)
            raise CorruptRecord(f"{path}: damaged on disk ({e.message}); the run wrote it itself, so it was set "
                                f"aside as {aside.name} and the next attempt rebuilds it; this attempt fails and is "
                                f"requeued (--max-failures)") from None
    raise AssertionError("unreachable")


class RendezvousTaken(UserError):
    """The weight-sync rendezvous of this attempt was already published."""


class Control:
    def __init__(self, run: RunDir | str | Path, *, readonly: bool = False):
        """`readonly`: a reader that must not change the run (`rlslurm status`): a damaged record is
        left in place and reads as absent (`read_record`)."""
        self.run = as_rundir(run)
        self.readonly = readonly
        self.dir = self.run.control_dir
        self.heartbeat_dir = self.dir / "heartbeats"
        self._heartbeat_mode: int | None = None  # set with the heartbeat directory, at the first beat

    # --- generic ----------------------------------------------------------------------
    def _write(self, name: str, rec: _Record) -> None:
        ensure_dir(self.dir)
        write_json_atomic(self.dir / name, rec.model_dump(mode="json"))

    def _read(self, path: Path, model: type[R], seen: Listing | None = None) -> R | None:
        """`seen`: a listing of control/ just taken (`listing`), not taken again for this record."""
        return read_record(path, model, readonly=self.readonly) if seen is None else seen.read(path.name, model)

    def listing(self) -> Listing:
        return Listing(self.dir, readonly=self.readonly)

    # --- engines / router ---------------------------------------------------------------
    def write_engines(self, engines: list[EngineRecord]) -> None:
        self._write("engines.json", EnginesRecord(engines=engines))

    def engines(self, seen: Listing | None = None) -> list[EngineRecord]:
        rec = self._read(self.dir / "engines.json", EnginesRecord, seen)
        return [] if rec is None else rec.engines

    def write_span(self, rec: SpanRecord) -> None:
        self._write(f"span-{rec.engine}.json", rec)

    def span(self, engine: str) -> SpanRecord | None:
        return self._read(self.dir / f"span-{engine}.json", SpanRecord)

    def write_span_rank(self, rec: SpanRankRecord) -> None:
        self._write(f"span-{rec.engine}-rank{rec.node_rank}.json", rec)

    def span_rank(self, engine: str, node_rank: int) -> SpanRankRecord | None:
        return self._read(self.dir / f"span-{engine}-rank{node_rank}.json", SpanRankRecord)

    def write_router(self, url: str) -> None:
        self._write("router.json", RouterRecord(url=url))

    def router(self) -> RouterRecord | None:
        return self._read(self.dir / "router.json", RouterRecord)

    # --- weight sync ------------------------------------------------------------------
    def rendezvous_path(self, attempt: int) -> Path:
        return self.dir / f"rendezvous-{attempt}.json"

    def publish_rendezvous(self, rec: RendezvousRecord) -> None:
        """Publish this attempt's rendezvous exactly once: a second publisher (a stale
        process of the same attempt) gets RendezvousTaken instead of silently
        pointing engines at another port."""
        ensure_dir(self.dir)
        if not publish_exclusive(self.rendezvous_path(rec.attempt), dumps_json(rec.model_dump(mode="json"))):
            raise RendezvousTaken(f"{self.rendezvous_path(rec.attempt)}: "
                                  f"rendezvous of attempt {rec.attempt} already published")

    def rendezvous(self, attempt: int) -> RendezvousRecord | None:
        return self._read(self.rendezvous_path(attempt), RendezvousRecord)

    def wait_for_rendezvous(self, attempt: int, timeout: float, poll_interval: float = 0.2,
                            cancel: Cancel = None) -> RendezvousRecord:
        deadline = time.monotonic() + timeout
        while True:
            rec = self.rendezvous(attempt)
            if rec is not None:
                return rec
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self.rendezvous_path(attempt)}: no weight-sync rendezvous within {timeout:g} s")
            sleep_or_cancel(poll_interval, cancel)

    def set_weight_version(self, version: int, *, transport: str | None = None, fallbacks: int = 0,
                           last_fallback: str | None = None) -> None:
        """`last_fallback`: kept from the record before when not given (the attempt's newest fallback)."""
        if last_fallback is None and fallbacks:
            old = self.weight_version()
            last_fallback = old.last_fallback if old is not None else None
        self._write("weight_version.json", WeightVersionRecord(version=version, transport=transport,
                                                               fallbacks=fallbacks, last_fallback=last_fallback))

    def weight_version(self) -> WeightVersionRecord | None:
        return self._read(self.dir / "weight_version.json", WeightVersionRecord)

    @property
    def weight_update_file(self) -> Path:
        return self.dir / "weight_update.json"

    def mark_weight_update(self, version: int, budget_s: float) -> WeightUpdateRecord:
        """Open the bracket: version `version` is being written for at most `budget_s` from now."""
        rec = WeightUpdateRecord(version=version, until=time.time() + budget_s)
        self._write(self.weight_update_file.name, rec)
        return rec

    def clear_weight_update(self) -> None:
        unlink_durable(self.weight_update_file)

    def weight_update(self) -> WeightUpdateRecord | None:
        """The bracket's record, stale or not (its reader decides); DataError if it is corrupt."""
        return self._read(self.weight_update_file, WeightUpdateRecord)

    # --- the colocated trainer's turn (trainer/colocate.py, engines/turn_watch.py) -------
    @property
    def turn_file(self) -> Path:
        return self.dir / "colocate_turn.json"

    def mark_turn(self, version: int, budget_s: float, since: float) -> TurnRecord:
        rec = TurnRecord(version=version, until=time.time() + budget_s, since=since)
        self._write(self.turn_file.name, rec)
        return rec

    def clear_turn(self) -> None:
        unlink_durable(self.turn_file)

    def turn(self) -> TurnRecord | None:
        return self._read(self.turn_file, TurnRecord)

    @property
    def colocation_memory_file(self) -> Path:
        return self.dir / "colocate_memory.json"

    def write_colocation_memory(self, rec: ColocationMemory) -> None:
        self._write(self.colocation_memory_file.name, rec)

    def colocation_memory(self, attempt: int) -> ColocationMemory | None:
        """This attempt's record, or None while its trainer has not written it."""
        rec = self._read(self.colocation_memory_file, ColocationMemory)
        return rec if rec is not None and rec.attempt == attempt else None

    # --- heartbeats -------------------------------------------------------------------
    def heartbeat(self, role: str, rank: int = 0, *, phase: str | None = None,
                  phase_since: float | None = None) -> Heartbeat:
        hb = Heartbeat(role=role, rank=rank, phase=phase, phase_since=phase_since)
        if self._heartbeat_mode is None:  # once per process: a stat per beat is a metadata op per beat
            ensure_dir(self.heartbeat_dir)
            self._heartbeat_mode = self.run.private_file_mode()  # no chmod per beat in a private run
        # atomic, not durable: a heartbeat lost in a crash says nothing its writer's death does not
        write_json_atomic(self.heartbeat_dir / f"{role}-{rank}.json", hb.model_dump(mode="json"), durable=False,
                          mode=self._heartbeat_mode)
        return hb

    def heartbeats(self) -> list[Heartbeat]:
        out = []
        for name in sorted(listdir_fresh(self.heartbeat_dir)):
            if name.endswith(".json") and not name.startswith("."):
                try:
                    hb = self._read(self.heartbeat_dir / name, Heartbeat)
                except CorruptRecord as e:  # set aside; its process writes a new one within seconds
                    log.warning("%s", e)
                    continue
                if hb is not None:
                    out.append(hb)
        return out

    def stale_heartbeats(self, max_age_s: float) -> list[Heartbeat]:
        now = time.time()
        return [hb for hb in self.heartbeats() if now - hb.time > max_age_s]

    # --- preempt / stop ---------------------------------------------------------------
    @property
    def preempt_file(self) -> Path:
        return self.dir / "preempt.json"

    @property
    def preempt_ack_file(self) -> Path:
        return self.dir / "preempt_ack.json"

    @property
    def stop_file(self) -> Path:
        return self.dir / "stop.json"

    def preempt_requested(self) -> dict | None:
        """The batch script's preempt request (written on USR1), or None."""
        rec = self._read(self.preempt_file, PreemptRequest)
        return None if rec is None else rec.model_dump()

    def ack_preempt(self, checkpoint_iteration: int) -> None:
        """Tell the batch trap the preempt checkpoint is saved; it then requeues."""
        self._write("preempt_ack.json", PreemptAck(checkpoint_iteration=checkpoint_iteration))

    def preempt_ack(self) -> PreemptAck | None:
        return self._read(self.preempt_ack_file, PreemptAck)

    def request_stop(self, reason: str) -> None:
        self._write("stop.json", StopRequest(reason=reason))

    def stop_requested(self) -> StopRequest | None:
        return self._read(self.stop_file, StopRequest)

    def requests(self, seen: Listing | None = None) -> "Requests":
        """The stop and preempt requests and their acks from one listing of control/ (`seen`, or one taken
        now), each record there read and validated as stop_requested() and the others read it. The
        pollers (the rollout nodes' look for the run's end, the driver's stop check, trainer rank 0's
        poll) ask this: a listing per record was 4 metadata operations per record and look
        (docs/shared-fs-load.md); rollout/main.py `Look` tells an acknowledged end from a request."""
        seen = self.listing() if seen is None else seen
        return Requests(stop=seen.read(self.stop_file.name, StopRequest),
                        stop_ack=seen.read(self.stop_ack_file.name, PreemptAck),
                        preempt=seen.read(self.preempt_file.name, PreemptRequest),
                        preempt_ack=seen.read(self.preempt_ack_file.name, PreemptAck))

    @property
    def stop_ack_file(self) -> Path:
        return self.dir / "stop_ack.json"

    def ack_stop(self, checkpoint_iteration: int) -> None:
        """The trainer has saved its last trained rollout and is exiting: nothing needs the engines."""
        self._write("stop_ack.json", PreemptAck(checkpoint_iteration=checkpoint_iteration))

    def stop_ack(self) -> PreemptAck | None:
        return self._read(self.stop_ack_file, PreemptAck)

    def mark_data_exhausted(self, rollout_id: int, attempt: int, message: str) -> None:
        self._write("data_exhausted.json", DataExhausted(rollout_id=rollout_id, attempt=attempt, message=message))

    def data_exhausted(self, attempt: int, seen: Listing | None = None) -> DataExhausted | None:
        """This attempt's exhaustion record, or None (an earlier attempt's record is ignored)."""
        rec = self._read(self.dir / "data_exhausted.json", DataExhausted, seen)
        return rec if rec is not None and rec.attempt == attempt else None

    def clear_stop(self) -> bool:
        """Forget a stop request and its ack (the user continues the run). True if there was one."""
        had = self.stop_file.exists()
        for f in (self.stop_file, self.stop_ack_file):
            unlink_durable(f)
        return had
