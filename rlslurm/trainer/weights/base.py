"""What every weight publisher shares: the interface the trainer calls (`WeightPublisher`), the two
publishers that send nothing, the errors a sync ends with, the trainer-side options of a sync
(`SyncOptions`, from the run's plan: rlslurm/settings/weight_plan.py), each rank's part in it (`Roles`), and
what an engine transport supplies to the tries around it (`Transport`: broadcast.py, ipc.py; the
tries, the bracket and the fallback are tries.py's).

A publisher is called on every trainer rank with the model and the version, and returns the
`Delivered` record of what delivered it (record.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

from rlslurm.buffer.control import Control
from rlslurm.errors import ConfigError, UserError
from rlslurm.settings.weight_plan import WeightSyncPlan
from rlslurm.trainer.weights.record import Delivered


class WeightPublisher(Protocol):
    def publish(self, model: torch.nn.Module, version: int) -> Delivered: ...


class NullPublisher:
    """Replay runs: no engine listens."""

    def publish(self, model: torch.nn.Module, version: int) -> Delivered:
        return Delivered(version, "none")


class VersionRecorder:
    """--debug-train-only (no engines): no weights go anywhere, but the trained version is recorded
    (control/weight_version.json, rank 0) so that the engine-free rollout driver stays within
    --async-buffer-size + 1 rollouts of the trainer (rollout/driver.py)."""

    def __init__(self, control: Control):
        self.control = control

    def publish(self, model: torch.nn.Module, version: int) -> Delivered:
        if not dist.is_initialized() or dist.get_rank() == 0:
            self.control.set_weight_version(version, transport="none")
        return Delivered(version, "none")


class WeightSyncError(RuntimeError):
    """A weight sync failed after every try and there is no fallback (--weight-sync-fallback off):
    the attempt fails and SLURM requeues it within --max-failures."""


class WeightSyncSetupError(UserError):
    """The weight-sync group cannot be built on this layout (NCCL refuses two ranks on one GPU):
    a retry, the fallback or a requeue would meet the same GPUs, so the job ends with the reason."""


class SyncInterrupted(RuntimeError):
    """The job is ending (a stop, a preempt request, a TERM) while a sync was in flight: the sync is
    abandoned on every rank and the trainer checkpoints (the next attempt publishes the version)."""


# NCCL's words for a group it refuses to build (ncclInvalidUsage), e.g. "Duplicate GPU detected :
# rank 0 and rank 1 both on CUDA device 60" (docs/gpu.md): tried again it fails the same way.
SETUP_REFUSALS = ("Duplicate GPU detected", "ncclInvalidUsage", "invalid usage")


def setup_refusal(errors: list[str]) -> str | None:
    return next((e for e in errors if any(w in e for w in SETUP_REFUSALS)), None)


@dataclass(frozen=True)
class SyncOptions:
    bucket_bytes: int = 512 * 1024**2       # train.update_weight_buffer_size
    timeout_s: float = 300.0                # train.weight_sync_timeout_s: bound of every step
    attempts: int = 2                       # distributed tries per publish, each on a fresh group
    backend: Literal["gloo", "nccl"] | None = None   # None: nccl when the trainer is on CUDA
    dtype: torch.dtype | None = None        # cast while exporting (None: the parameters' dtype)
    pause_mode: Literal["abort", "retract", "in_place"] = "abort"
    group_prefix: str = "rlslurm-wsync"
    flattened: bool = False                 # train.update_weight_flattened_bucket: one broadcast per bucket
    receiver: Literal["sglang", "rlslurm"] = "sglang"  # train.update_weight_receiver (engines/receiver.py)
    # an FP8 or INT4 --hf-checkpoint (plan.fp8_block, plan.int4_group): the weights it stored quantized
    # go out in its layout (convert/fp8.py `Fp8Export`, convert/int4.py `Int4Export`, read off the
    # checkpoint by factory.py); None: unquantized
    quantizer: Any = None

    def __post_init__(self) -> None:
        if self.bucket_bytes < 1:
            raise ConfigError(f"update_weight_buffer_size must be >= 1 byte, got {self.bucket_bytes}")
        if self.timeout_s <= 0:
            raise ConfigError(f"weight_sync_timeout_s must be > 0, got {self.timeout_s}")
        if self.attempts < 1:
            raise ConfigError(f"weight sync attempts must be >= 1, got {self.attempts}")

    @classmethod
    def from_plan(cls, plan: WeightSyncPlan, **kw: Any) -> "SyncOptions":
        """The trainer's side of the run's weight-sync plan (rlslurm/settings/weight_plan.py), which resolved
        the backend and the transport; `kw`: what only the trainer knows (the export's dtype)."""
        return cls(bucket_bytes=plan.bucket_bytes, timeout_s=plan.timeout_s, backend=plan.backend,
                   flattened=plan.flattened, receiver=plan.receiver, **kw)


@dataclass
class Roles:
    """What this trainer rank does in a publish (the transport decides: broadcast.py, ipc.py)."""

    exporter: bool     # takes part in the export's gathers (convert/parallel.py export_roles)
    leader: bool       # rank 0 of its stage's group
    coordinator: bool  # the stage-0 leader: brackets the update, records the version
    stage: int
    stages: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


def megatron_roles() -> Roles:
    from megatron.core import parallel_state as ps

    from rlslurm.convert.parallel import export_roles

    roles = export_roles()  # the export's gathers decide who exports (convert/export.py)
    stage, stages = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return Roles(exporter=roles.exporter, leader=roles.sender, coordinator=roles.sender and stage == 0,
                 stage=stage, stages=stages, device=dev)


class Transport(Protocol):
    """How an engine transport moves one version, inside the tries of tries.py `SyncPublisher`, which
    it is handed as `pub` (its collectives `step`, `agree`, `gather`, `stream`, its `sender`)."""

    sent: str  # the log's verb: "broadcast", "copied in place"

    def roles(self) -> Roles: ...

    def name(self, opts: SyncOptions, r: Roles) -> str:
        """The transport record's name of a version it delivers (rlslurm/settings/weight_plan.py `delivered_by`)."""
        ...

    def new_sender(self, pub: Any, r: Roles) -> Any: ...

    def join(self, pub: Any, r: Roles, ok: bool, errors: list[str]) -> bool:
        """Collective: reach the engines (a group, or their buffers' readers)."""
        ...

    def transfer(self, pub: Any, model: torch.nn.Module, r: Roles, ok: bool, errors: list[str]) -> bool:
        """Collective: every bucket of the export to the engines."""
        ...

    def refusal_detail(self, pub: Any, r: Roles) -> str:
        """What to add to a refused group's one-line error (the GPUs of its members), or ""."""
        ...
