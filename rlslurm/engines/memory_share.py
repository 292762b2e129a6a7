"""How much of a GPU a colocated engine takes: its `--mem-fraction-static`, derived when the user gives
none (docs/colocate.md, "The engines' memory share").

SGLang sizes an engine's weights + KV cache as `--mem-fraction-static` x the GPU memory free when the
engine starts, and leaves the rest of that free memory to its own activations (docs/sglang-behaviour.md,
"How SGLang sizes its memory"). Its default share is computed from the GPU's size alone, as if the engine
had the GPU to itself. Colocated, the trainer is on the same GPU: what it holds while the engines
generate, and what it may take beside them later (its params, onloaded to publish to a restarted engine
or to probe a version, and the transfer buckets), must come out of the engines' share, or the engines'
resume after the trainer's turn runs out of memory.

So colocated engines start only once the trainer has built its model and moved its state off the GPU
(the trainer's `ColocationMemory` record, control/colocate_memory.json): each engine's wrapper process
(engines/engine.py `_main`) imports SGLang while the trainer builds, waits for that record, and then,
the free memory it sees excluding what the trainer holds, gives SGLang

    share = 1 - (sglang_reserve + margin) / free

where `sglang_reserve` is what SGLang's own default leaves for activations on this GPU ((1 - its default
share) x the GPU's size), `margin` is what the trainer may take beside the engines (`trainer_margin`),
and `free` the GPU's free memory at the engine's start (the least over its GPUs on the node). The value
and its terms are logged in the engine's log and written beside it, a line per start of the engine
(`<engine log>.memory.jsonl`). A share
the user gave is kept, with a warning when it is larger than the derived one.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlslurm.errors import ConfigError

if TYPE_CHECKING:
    from rlslurm.buffer.control import ColocationMemory

ENV = "RLSLURM_ENGINE_MEMORY"  # the engine's MemoryPlan as JSON, set by the rollout node (EngineSpec.env)
ENV_RECORD = ENV + "_RECORD"  # where the engine's process appends its Share (a JSON line per start)
GIB = 2**30
# What the trainer's resident state may grow by between its first offload (when the engines are sized)
# and a later turn: cuBLAS workspaces, allocator blocks of tensors made at the first step that stay
# (docs/colocate.md). The larger of a fixed amount and a share of the GPU.
GROWTH_MIN_BYTES = 1 * GIB
GROWTH_SHARE = 0.01
# How long an engine that shares its GPUs waits for the trainer to build (and load) its model and leave
# them: a large checkpoint's load included
TRAINER_BUILD_WAIT_S = 3600.0
# The most tokens an engine's KV pool is given (`--max-total-tokens`) where the user gives no bound and the
# share would hold more: SGLang's token allocator keeps one int64 per token of its pool in a free list, and
# each free concatenates that list, outside the static share and SGLang's reserve. A tiny MLA config
# (128 bytes of KV a token) on an 80 GB H100 got a pool of 521 M tokens, and its engine died at its first
# free ("Tried to allocate 3.88 GiB"; bench/results/gpu-lease-2026-12-07b.md). 2^24 tokens keep that list
# at 128 MiB; the bound binds only below 8 KiB of KV a token on a 141 GB GPU, far under any real model's
# per-GPU figure but for the smallest at a large TP.
MAX_POOL_TOKENS = 2**24
# The least KV cache worth starting an engine with: below it the share is refused in one line rather
# than left to SGLang's "Loaded weights leave no GPU memory for the KV cache".
MIN_KV_BYTES = 1 * GIB


class EngineMemoryError(ConfigError):
    """The engines cannot fit beside the trainer on this GPU: a setting must change."""


# --shared-gpu (a test layout of `rlslurm run`): the trainer trains while the engines generate, and its
# activations' peak is not known before its first step: this share of the GPU is kept for it.
TRAINING_SHARE = 0.25


def check_given_share(sglang_args: list[str] | tuple[str, ...]) -> None:
    """At submit: a --sglang-mem-fraction-static that no GPU could take. Whether one below 1 fits beside
    the trainer is known only on the node (the engine's log warns, `Share.risky`)."""
    given = _flag(list(sglang_args), "--mem-fraction-static")
    if given is None:
        return
    try:
        value = float(given)
    except ValueError:
        value = -1.0
    if not 0.0 < value < 1.0:
        raise EngineMemoryError(f"--sglang-mem-fraction-static {given}: the engines' share of a GPU's free memory "
                                f"is a number between 0 and 1 (leave it out and rlslurm derives it colocated)")


def trainer_margin(params_bytes: int, bucket_bytes: int, total_bytes: int, *, trains_beside: bool = False) -> int:
    """What one trainer rank may take on its GPU beside engines that hold their whole share: its params
    (onloaded for a publish again to a restarted engine, or for --verify-weight-sync's probe), one
    transfer bucket, and room to grow; `trains_beside` (--shared-gpu): its training too."""
    margin = params_bytes + bucket_bytes + max(GROWTH_MIN_BYTES, int(GROWTH_SHARE * total_bytes))
    return margin + (int(TRAINING_SHARE * total_bytes) if trains_beside else 0)


@dataclass(frozen=True)
class MemoryPlan:
    """What the rollout node tells an engine that shares its GPUs with the trainer: where the trainer's
    record of this attempt will be, and the model's weights per engine GPU (as served)."""

    record: str            # RUN/control/colocate_memory.json
    attempt: int
    weights_bytes: int
    kv_bytes_per_token: int = 0  # on one of the engine's GPUs (`kv_bytes_per_token`); 0: unknown

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls, text: str) -> "MemoryPlan":
        return cls(**json.loads(text))


def wait_for_trainer(plan: MemoryPlan, timeout_s: float | None = None) -> "ColocationMemory":
    """The trainer's record of this attempt: its state is off the GPUs, and its margin per GPU."""
    from rlslurm.buffer.control import ColocationMemory, read_record

    timeout_s = TRAINER_BUILD_WAIT_S if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout_s
    while True:
        rec = read_record(Path(plan.record), ColocationMemory)
        if rec is not None and rec.attempt == plan.attempt:
            return rec
        if time.monotonic() > deadline:
            raise EngineMemoryError(f"the trainer of attempt {plan.attempt} did not build its model and leave the "
                                    f"GPUs to the engines within {timeout_s:g} s ({plan.record})")
        time.sleep(0.5)


def margin_on(rec: "ColocationMemory", devices: list[int]) -> int:
    """The trainer's margin on the GPUs of CUDA devices `devices` (the largest; every GPU's where they
    cannot be told apart)."""
    from rlslurm.gpus import device_uuids

    uuids = device_uuids(devices) or []
    mine = [rec.margins[u] for u in uuids if u in rec.margins]
    return max(mine or rec.margins.values() or [0])


@dataclass(frozen=True)
class Share:
    fraction: float
    derived: bool          # False: the user's --sglang-mem-fraction-static
    total_gib: float
    free_gib: float        # at the engine's start, the least over its GPUs here
    sglang_reserve_gib: float
    margin_gib: float
    sglang_default: float | None
    derived_fraction: float | None  # what rlslurm would give (None: nothing fits; `fraction` when derived)
    max_total_tokens: int | None = None  # the KV pool's bound rlslurm gave (MAX_POOL_TOKENS), None: SGLang's
    pool_tokens: int | None = None       # the tokens the share would hold unbounded (estimate), None: unknown

    def describe(self) -> str:
        terms = (f"{self.free_gib:.1f} GiB free of {self.total_gib:.1f} at the engine's start (the trainer's "
                 f"state off the GPU); SGLang's reserve for activations {self.sglang_reserve_gib:.1f} GiB "
                 f"(its default share {self.sglang_default}); the trainer's margin {self.margin_gib:.1f} GiB")
        if self.max_total_tokens is not None:
            terms += (f"; --max-total-tokens {self.max_total_tokens} given by rlslurm (the share holds about "
                      f"{self.pool_tokens} tokens of KV, and SGLang's allocator keeps 8 bytes a token beside it)")
        if self.derived:
            return f"--mem-fraction-static {self.fraction:.3f} derived by rlslurm: {terms}"
        would = "nothing that fits" if self.derived_fraction is None else f"{self.derived_fraction:.3f}"
        return f"--mem-fraction-static {self.fraction:.3f} given by the user (rlslurm would derive {would}: {terms})"

    @property
    def risky(self) -> bool:
        """A user's share larger than what fits beside the trainer: the resume after a turn may OOM."""
        return not self.derived and (self.derived_fraction is None or self.fraction > self.derived_fraction)


def derive(*, total: int, free: int, sglang_default: float, margin: int, weights: int) -> float:
    """The engine's share of `free` (bytes), three decimals, rounded down; EngineMemoryError when its
    weights and the least KV cache do not fit."""
    reserve = (1.0 - sglang_default) * total
    fraction = math.floor((1.0 - (reserve + margin) / free) * 1000) / 1000
    if fraction * free < weights + MIN_KV_BYTES:
        raise EngineMemoryError(
            f"--colocate: {free / GIB:.1f} GiB of the GPU are free beside the trainer; SGLang keeps "
            f"{reserve / GIB:.1f} GiB for activations and the trainer needs {margin / GIB:.1f} GiB beside the "
            f"engines, which leaves {max(fraction, 0) * free / GIB:.1f} GiB for {weights / GIB:.1f} GiB of "
            f"weights and a KV cache: the model does not fit colocated on this GPU (use more GPUs per engine "
            f"with --rollout-num-gpus-per-engine, or separate GPUs for the trainer and the engines)")
    return fraction


def gpu_memory(devices: list[int]) -> tuple[int, int]:
    """(total, free) bytes of the CUDA devices `devices` as this process numbers them: the least of
    each over them (an engine over several GPUs is sized by its fullest). Read with nvidia-smi, not
    torch: a CUDA context in the server's main process would hold memory of its own."""
    from rlslurm.gpus import device_uuids, normal_uuid

    uuids = device_uuids(devices)
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=uuid,memory.total,memory.free",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30,
                             check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise EngineMemoryError(f"--colocate: the GPUs' free memory cannot be read to size the engine's share "
                                f"(nvidia-smi: {e}); give it with --sglang-mem-fraction-static") from None
    rows = {normal_uuid(u): (int(t) * 2**20, int(f) * 2**20)
            for u, t, f in (line.split(",") for line in out.splitlines() if line.count(",") == 2)}
    mine = [rows[u] for u in uuids or [] if u in rows] or list(rows.values())
    if not mine:
        raise EngineMemoryError("--colocate: nvidia-smi lists no GPU to size the engine's memory share with")
    return min(t for t, _ in mine), min(f for _, f in mine)


def _flag(args: list[str], name: str) -> str | None:
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def engine_devices(args: list[str]) -> list[int]:
    base = int(_flag(args, "--base-gpu-id") or 0)
    tp = int(_flag(args, "--tp-size") or 1)
    nnodes = int(_flag(args, "--nnodes") or 1)
    return list(range(base, base + tp // nnodes))


def sglang_default_share(args: list[str]) -> float:
    """SGLang's own default --mem-fraction-static for these server flags (its server_args heuristic from
    the GPU's size, chunked prefill and CUDA-graph batch sizes), asked of SGLang itself so that it
    follows the installed version."""
    from sglang.srt.server_args import prepare_server_args

    return float(prepare_server_args([a for a in args if not a.startswith("--api-key")]).mem_fraction_static)


def size_engine(args: list[str], margin: int, weights: int, record: Path | None,
                kv_bytes_per_token: int = 0) -> tuple[list[str], Share]:
    """In the engine's wrapper process before SGLang starts, the trainer's state off the GPU: `args` with
    the share appended (or the user's kept), and what it is; and where the share would hold more than
    MAX_POOL_TOKENS tokens of KV (`kv_bytes_per_token` known, no --max-total-tokens given), that bound.
    Appends it to `record` (a JSON line per start of the engine)."""
    given = _flag(args, "--mem-fraction-static")
    total, free = gpu_memory(engine_devices(args))
    default = sglang_default_share(_without(args, "--mem-fraction-static"))
    try:
        derived: float | None = derive(total=total, free=free, sglang_default=default, margin=margin,
                                       weights=weights)
    except EngineMemoryError:
        if given is None:
            raise
        derived = None  # the user's share stands; the warning says nothing else would fit
    fraction = derived if given is None else float(given)
    pool = int((fraction * free - weights) // kv_bytes_per_token) if kv_bytes_per_token > 0 else None
    bound = MAX_POOL_TOKENS if (pool is not None and pool > MAX_POOL_TOKENS
                                and _flag(args, "--max-total-tokens") is None) else None
    share = Share(fraction=fraction, derived=given is None,
                  total_gib=total / GIB, free_gib=free / GIB, sglang_reserve_gib=(1 - default) * total / GIB,
                  margin_gib=margin / GIB, sglang_default=default, derived_fraction=derived,
                  max_total_tokens=bound, pool_tokens=pool)
    if record is not None:
        with open(record, "a") as f:
            f.write(json.dumps(asdict(share)) + "\n")
    if given is None:
        args = [*args, "--mem-fraction-static", f"{share.fraction:.3f}"]
    if bound is not None:
        args = [*args, "--max-total-tokens", str(bound)]
    return args, share


def _without(args: list[str], name: str) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a == name:
            skip = True
            continue
        if a.startswith(name + "="):
            continue
        out.append(a)
    return out


def record_path(log_path: Path) -> Path:
    return log_path.with_name(log_path.name.removesuffix(".log") + ".memory.jsonl")


def apply_from_env(args: list[str], *, cuda: bool) -> list[str]:
    """engines/engine.py `_main`, for an engine that shares its GPUs with the trainer: wait for the
    trainer to leave the GPUs (SGLang's import, on GPUs, done first: it overlaps the trainer's build),
    then, on GPUs, size the engine's share."""
    text = os.environ.pop(ENV, None)
    if not text:
        return args
    plan = MemoryPlan.from_env(text)
    record = os.environ.pop(ENV_RECORD, None)
    if cuda:
        import sglang.srt.server_args  # noqa: F401  (seconds of imports, while the trainer builds its model)
    print(f"rlslurm engine memory: waiting for the trainer to build its model and leave the GPUs ({plan.record})",
          file=sys.stderr, flush=True)
    rec = wait_for_trainer(plan)
    if rec.offload is not None:
        print(f"rlslurm engine memory: the trainer {rec.offload.line}", file=sys.stderr, flush=True)
    if not cuda:
        return args
    args, share = size_engine(args, margin_on(rec, engine_devices(args)), plan.weights_bytes,
                              Path(record) if record else None, plan.kv_bytes_per_token)
    level = "warning" if share.risky else "info"
    print(f"rlslurm engine memory ({level}): {share.describe()}", file=sys.stderr, flush=True)
    return args


def serving_dtype_bytes(cfg: Any) -> int:
    """The bytes of one weight as the engines serve: 4 for --rollout-dtype float32, else 2 (`auto`:
    16-bit, as GPU engines serve an fp32 checkpoint: docs/sglang-behaviour.md)."""
    return 4 if (cfg.rollout.rollout_dtype or "auto") in ("float32", "float") else 2


def serving_weights_bytes(cfg: Any, mc: Any) -> int:
    """The model's weights as the engines serve them, over all of an engine's GPUs: the parameter count of
    `mc` (the run's model config; settings/model_config.py's estimate) x the serving dtype's bytes."""
    return mc.num_params * serving_dtype_bytes(cfg)


def kv_bytes_per_token(arch: Any, tp: int, dtype_bytes: int) -> int:
    """The KV cache of one token on one of an engine's `tp` GPUs. Grouped-query attention: K and V of
    every KV head of every layer, the heads split over TP (a head per GPU at least: SGLang replicates
    them when TP exceeds their number). MLA: the compressed latent and the rotary key of every layer,
    whole on every GPU (not split by heads); GLM-5's indexer keys are not counted. Qwen3-Next's gated
    delta net layers keep a state per request, not per token: only its full-attention layers count."""
    if arch.mla is not None:
        return (arch.mla.kv_lora_rank + arch.mla.qk_pos_emb_head_dim) * arch.num_layers * dtype_bytes
    layers = arch.num_layers
    if arch.gated_delta_net is not None:
        layers = arch.num_layers // arch.gated_delta_net.full_attention_interval
    heads = math.ceil(arch.num_query_groups / tp)
    return 2 * layers * heads * arch.kv_channels * dtype_bytes


def kv_dtype_bytes(cfg: Any) -> int:
    """The bytes of one KV cache element as the engines serve: 1 with --sglang-kv-cache-dtype fp8*, else
    the serving dtype's (4 for --rollout-dtype float32, else 2)."""
    kv_dtype = _flag(list(cfg.sglang_args), "--kv-cache-dtype") or "auto"
    return 1 if kv_dtype.startswith("fp8") else serving_dtype_bytes(cfg)


def serving_kv_bytes_per_token(cfg: Any, mc: Any, tp: int) -> int:
    """The KV cache of one token on one of an engine's `tp` GPUs as the engines serve `mc`, the run's model."""
    return kv_bytes_per_token(mc.arch, tp, kv_dtype_bytes(cfg))
