"""The weight-sync plan: every weight-sync setting of the run, resolved once from the config into one
frozen record that both roles read (the trainer's publisher and delivery, the rollout node's engine
flags and update watch, the driver's disk loads). Each field names where it is consumed, so a
reader gets from a setting to its use in one hop; nothing else reads these config knobs.

It is one of the settings, not under either role: the trainer (het-group 0) and the rollout
(het-group 1) must pick the two ends of the same transport, so they take it from one rule instead of
each deciding its side. No torch, no role import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from rlslurm.settings.low_precision import stored_precision

# What can deliver a version, as the transport record names it (control/weight_version.json, each
# `Delivered` in metrics.jsonl: trainer/weights/record.py): a broadcast group's backend, CUDA IPC
# (--colocate on GPUs) or its CPU twin memfd, HF files on disk (--weight-sync disk, or the fallback),
# or nothing (no engine listens).
TRANSPORTS = ("nccl", "gloo", "cuda-ipc", "memfd", "disk", "none")


@dataclass(frozen=True)
class WeightSyncPlan:
    # --weight-sync: distributed (to the engines' memory) or disk (HF files the driver loads).
    # Consumers: trainer/weights/factory.py (the publisher), trainer/weights/delivery.py (whether a
    # publish waits for engines), rollout/node.py (the update watch), rollout/driver.py (disk loads).
    method: Literal["distributed", "disk"] = "distributed"
    # --weight-sync-transport, `auto` resolved: ipc with --colocate and PP 1, else broadcast.
    # Consumers: trainer/weights/factory.py (ipc.py or broadcast.py), rollout/node.py (the engine's
    # loader: `engine_loader`).
    transport: Literal["broadcast", "ipc"] = "broadcast"
    # --weight-sync-backend, `auto` resolved: gloo where the engines share the trainer's GPUs (an
    # engine on the trainer's own GPU cannot join an NCCL group with it, docs/gpu.md), else None:
    # NCCL from a CUDA trainer, gloo from a CPU one (decided by the device: `delivered_by`).
    # Consumer: trainer/weights/broadcast.py (the group), through SyncOptions.
    backend: Literal["nccl", "gloo"] | None = None
    # --update-weight-receiver, `auto` resolved at submit (`auto_receiver`): SGLang's per-bucket loader
    # or rlslurm's (engines/receiver.py).
    # Consumers: trainer/weights/broadcast.py (what it sends), rollout/node.py (`engine_loader`).
    receiver: Literal["sglang", "rlslurm"] = "sglang"
    # --update-weight-buffer-size: bytes per bucket. Consumer: trainer/weights/{broadcast,ipc}.py.
    bucket_bytes: int = 512 * 1024**2
    # --update-weight-flattened-bucket: one broadcast per bucket. Consumer: trainer/weights/broadcast.py.
    flattened: bool = False
    # --weight-sync-fallback: what delivers a version whose transport failed every try.
    # Consumer: trainer/weights/factory.py (a DiskPublisher as the fallback, or none).
    fallback: Literal["disk", "off"] = "disk"
    # --weight-sync-timeout-s: the bound of each weight-sync step. Consumers: trainer/weights/ (each
    # step, the wait for engines), trainer/colocate.py (each call of a turn), rollout/node.py (how long
    # an update or a turn may hold the engines' restarts).
    timeout_s: float = 300.0
    # --verify-weight-sync: the greedy probe after each publish. Consumer: trainer/weights/delivery.py.
    verify: bool = False
    # --hf-checkpoint is block-wise FP8 (settings/low_precision.py `fp8_block`): the engines serve FP8
    # (SGLang reads the checkpoint's quantization_config; rollout/node.py adds --quantization fp8), so
    # what is synced or written for them is FP8 in these weight blocks plus `_scale_inv` tensors, the
    # checkpoint's names (convert/fp8.py `Fp8Export`). None: the trainer's dtype, unquantized.
    # Consumers: trainer/weights/factory.py (the publishers' quantizer), rollout/node.py (engine flags).
    fp8_block: tuple[int, int] | None = None
    # --hf-checkpoint is INT4 W4A16 compressed-tensors (settings/low_precision.py `int4_scheme`): the
    # engines serve its INT4 experts (rollout/node.py pins SGLang's Marlin MoE, the one it can reload),
    # so what is synced or written for them is INT4 in groups of this many columns, as
    # weight_packed/weight_scale/weight_shape in the checkpoint's names (convert/int4.py `Int4Export`).
    # None: not INT4. Consumers: trainer/weights/factory.py, rollout/node.py.
    int4_group: int | None = None

    @property
    def quantized(self) -> bool:
        """The engines serve a quantized checkpoint, so a sync sends its layout."""
        return self.fp8_block is not None or self.int4_group is not None

    @property
    def by_disk(self) -> bool:
        return self.method == "disk"

    @property
    def engine_loader(self) -> bool:
        """The engines start with rlslurm's receiver as SGLang's custom weight loader: asked for, or
        needed by the IPC transport (it is how an engine reads a bucket in place)."""
        return self.receiver == "rlslurm" or self.transport == "ipc"

    def delivered_by(self, device_type: str) -> str:
        """The transport record's name (TRANSPORTS) for a version this plan delivers from a trainer on
        `device_type` ("cuda" or "cpu")."""
        return "disk" if self.by_disk else delivered_by(self.transport, self.backend, device_type)


def delivered_by(transport: str, backend: str | None, device_type: str) -> str:
    """The one rule that names a transport in the record: each publisher asks it for the name of
    what delivered a version (trainer/weights/broadcast.py, ipc.py)."""
    if transport == "ipc":
        return "cuda-ipc" if device_type == "cuda" else "memfd"
    return broadcast_backend(backend, device_type)


def broadcast_backend(backend: str | None, device_type: str) -> Literal["gloo", "nccl"]:
    """The broadcast group's backend: the configured one, else NCCL from a CUDA trainer."""
    if backend is not None:
        return backend  # type: ignore[return-value]
    return "nccl" if device_type == "cuda" else "gloo"


# Model families (config.json model_type) whose engines rlslurm's receiver has loaded on GPUs, every
# bucket by learnt copies: dense qwen3 through `rlslurm run` at engine TP 1 and 2, two engines and a PP 2
# trainer (bench/results/gpu-layouts-h100x4.md) and spanning two nodes (engine-span-h100x4.md); a
# Qwen3-30B-A3B shape at engine TP 2, faster than SGLang's own loader (production-shapes-h100x4.md).
# Other families keep SGLang's loader until a GPU run proves them (the receiver itself hands a bucket
# it cannot learn to load_weights: slower, not wrong).
RECEIVER_PROVEN = ("qwen3", "qwen3_moe")


def auto_receiver(device: str, hf_model_type: str, shares_gpus: bool,
                  quantized: bool = False) -> Literal["sglang", "rlslurm"]:
    """What `--update-weight-receiver auto` becomes (settled at submit, resolve.py, and kept in run.yaml):
    rlslurm's receiver on GPUs for the families proven there, over NCCL (the runs above; engines sharing
    the trainer's GPUs broadcast over gloo, not proven with it), SGLang's per-bucket loader elsewhere (CPU
    engines included: the CPU suite keeps SGLang's path as its default and tests the receiver by name).
    --colocate's IPC transport loads through the receiver whatever this says (`engine_loader`). An FP8
    or INT4 sync (`quantized`) keeps SGLang's loader: the receiver's runs above were bf16 (docs/low-precision.md)."""
    proven = device == "cuda" and hf_model_type in RECEIVER_PROVEN and not shares_gpus and not quantized
    return "rlslurm" if proven else "sglang"


def weight_sync_plan(cfg: Any) -> WeightSyncPlan:
    """The plan of a resolved RunConfig (layout.check has refused what cannot work: ipc without
    --colocate or with PP > 1, NCCL with --colocate)."""
    t = cfg.train
    stored = stored_precision(cfg.model.hf_checkpoint)  # FP8/INT4 weights go out as the checkpoint stores them
    transport = t.weight_sync_transport
    if transport == "auto":
        transport = "ipc" if cfg.run.colocate and t.pipeline_model_parallel_size == 1 else "broadcast"
    backend = t.weight_sync_backend
    if backend == "auto":
        backend = "gloo" if cfg.shares_gpus else None
    # `auto` is settled at submit; a config made without resolve (tests, tools) gets SGLang's loader
    receiver = "sglang" if t.update_weight_receiver == "auto" else t.update_weight_receiver
    return WeightSyncPlan(method=t.weight_sync, transport=transport, backend=backend,
                          receiver=receiver, bucket_bytes=t.update_weight_buffer_size,
                          flattened=t.update_weight_flattened_bucket, fallback=t.weight_sync_fallback,
                          timeout_s=t.weight_sync_timeout_s, verify=t.verify_weight_sync,
                          fp8_block=stored.fp8_block, int4_group=stored.int4.group_size if stored.int4 else None)
