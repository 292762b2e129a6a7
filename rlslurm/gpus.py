"""Which GPUs each group uses on one machine, and which physical GPU a process is on.

One decision, `role_gpus`, for every layout that puts both groups on one machine: `rlslurm run`
(the het job's two groups as two "nodes" of one box), `--shared-gpu`, `--colocate`, a replay or
`--debug-train-only` run (no engines), and a `--nodes 1` SLURM job's two steps (docs/single-node.md).
A het job's groups have nodes of their own; SLURM's CUDA_VISIBLE_DEVICES is right there.

Whether the engines need GPUs is `layout.no_engines_reason`, asked with the model config before the
run directory exists: a tiny model is served from RUN/hf_init, which `prepare_run_dir` writes only
later (deciding by the missing --hf-checkpoint would put the engines on the trainer's GPUs).

A process's physical GPU is its UUID (docs/gpu.md, "Which GPU"): the trainer reads it from torch, the
rollout node maps its engines' device numbers through nvidia-smi. The weight-sync group checks them
before NCCL would refuse two ranks on one GPU (trainer/weights/broadcast.py).
"""

from __future__ import annotations

import functools
import os
import subprocess
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlslurm.errors import ConfigError

if TYPE_CHECKING:
    from rlslurm.settings.config import RunConfig
    from rlslurm.settings.model_config import ModelConfig


def visible_gpus() -> list[str]:
    """The GPUs this process may use: CUDA_VISIBLE_DEVICES if set, else every GPU nvidia-smi lists."""
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return [g for g in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    return [row[0] for row in _nvidia_smi()]


@dataclass(frozen=True)
class GpuSplit:
    """How many GPUs each group takes on one machine. `shared`: both groups on the same GPUs
    (--colocate, --shared-gpu); else the trainer's `trainer` GPUs first, the engines' `engines` next."""

    trainer: int
    engines: int
    shared: bool
    flags: tuple[str, str]  # the flags that set `trainer` and `engines`, for the error message

    @property
    def need(self) -> int:
        return max(self.trainer, self.engines) if self.shared else self.trainer + self.engines


def gpu_split(cfg: "RunConfig", model: "ModelConfig | None" = None) -> GpuSplit:
    """The split of one machine's GPUs for this run. `model`: the run's model config, for a run whose
    checkpoint the run directory does not hold yet (`layout.no_engines_reason`)."""
    from rlslurm.settings.layout import no_engines_reason

    engines = 0 if no_engines_reason(cfg, model) else cfg.rollout_gpus_per_node
    return GpuSplit(cfg.trainer_procs_per_node, engines, cfg.shares_gpus, cfg.gpu_split_flags)


def assign(split: GpuSplit, visible: list[str]) -> tuple[list[str], list[str]]:
    """(trainer's, rollout's) CUDA_VISIBLE_DEVICES. Split: each group's own GPUs first (so it numbers
    them from 0, exactly as on a node of its own), then every other GPU of the machine, so that NCCL
    between the groups may use the peer GPU directly (hiding them works too: docs/gpu.md). Shared:
    both number the same GPUs from 0."""
    if len(visible) < split.need:
        if split.shared:
            raise ConfigError(f"the trainer and the engines share {split.need} GPU(s) (the larger of {split.flags[0]} "
                              f"and {split.flags[1]}), {len(visible)} visible on this machine")
        raise ConfigError(f"--device cuda: the trainer ({split.trainer} GPU(s), {split.flags[0]}) and the rollout "
                          f"engines ({split.engines}, {split.flags[1]}) need {split.need} GPUs, {len(visible)} "
                          "visible on this machine")
    if split.shared:
        return list(visible), list(visible)
    own_t, own_r = visible[:split.trainer], visible[split.trainer:split.trainer + split.engines]
    return own_t + [g for g in visible if g not in own_t], own_r + [g for g in visible if g not in own_r]


def role_gpus(cfg: "RunConfig", model: "ModelConfig | None" = None,
              visible: list[str] | None = None) -> tuple[list[str], list[str]]:
    """(trainer's, rollout's) CUDA_VISIBLE_DEVICES when both groups run on one machine; none to either on
    --device cpu. Too few GPUs is a ConfigError naming the flags."""
    if cfg.run.device != "cuda":
        # a CPU trainer that can see a GPU gets megatron's gradient buffers there beside its gloo group:
        # "ProcessGroupGloo::allreduce_coalesced: unsupported device type cuda" at its first step
        return [], []
    return assign(gpu_split(cfg, model), visible_gpus() if visible is None else visible)


def machine_gpu_flags(probe: "RunConfig", layers: list) -> list[str]:
    """`rlslurm run --device cuda` on one machine: --gpus-per-node from the GPUs it has, unless the user
    gave it (flags or YAML, `layers`) - all of them colocated or shared, half to each group otherwise
    (the trainer's `--gpus-per-node`, the engines' as many). One GPU is too few for two groups: the
    error names --colocate, which shares it."""
    if probe.run.device != "cuda" or any(("slurm", "gpus_per_node") in layer.values for layer in layers):
        return []
    n = len(visible_gpus())
    if n == 0:
        raise ConfigError("--device cuda: no GPU visible on this machine (nvidia-smi lists none, or "
                          "CUDA_VISIBLE_DEVICES is empty)")
    if probe.shares_gpus:
        return ["--gpus-per-node", str(n)]
    if n < 2:
        raise ConfigError("--device cuda: 1 GPU visible on this machine, and the trainer and the engines need one "
                          "each; --colocate shares it (they take turns, as slime's --colocate)")
    return ["--gpus-per-node", str(n // 2)]


def step_gpus(cfg: "RunConfig", role: str) -> str | None:
    """--nodes 1 in SLURM: the role's CUDA_VISIBLE_DEVICES, picked from the job's GPUs that both
    overlapping steps see (rlslurm/slurm/launch.py). None where SLURM's own is right: a het group's
    node belongs to its role alone, and --colocate shares every GPU. Split on --device cpu too when
    SLURM gave the job GPUs (gres): the step's environment is then what a GPU node's would be, which
    the SLURM test cluster's device-file GPUs check (tests/slurm/test_slurm_job.py)."""
    if not cfg.single_node or not cfg.slurm.trainer_gpus:
        return None
    visible = visible_gpus()
    if cfg.run.device != "cuda" and not visible:
        return None
    s = cfg.slurm  # the job's GPUs as layout.py split them (on --device cpu the trainer's procs differ)
    trainer, rollout = assign(GpuSplit(s.trainer_gpus, s.rollout_gpus or 0, cfg.shares_gpus, cfg.gpu_split_flags),
                              visible)
    return ",".join(trainer if role == "trainer" else rollout)


# --- physical identity ------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _nvidia_smi() -> tuple[tuple[str, str, str], ...]:
    """(index, uuid, pci bus id) of every GPU this process can see, in NVML's (PCI) order; () if
    nvidia-smi is missing or fails."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,pci.bus_id", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    rows = [tuple(x.strip() for x in line.split(",")) for line in out.splitlines() if line.strip()]
    return tuple(r for r in rows if len(r) == 3)  # type: ignore[misc]


def normal_uuid(uuid: str) -> str:
    """One spelling for a GPU UUID: nvidia-smi's `GPU-…` and torch's bare form compare equal."""
    u = uuid.strip().lower()
    return u if u.startswith(("gpu-", "mig-")) else f"gpu-{u}"


def device_uuids(devices: list[int], env: dict[str, str] | None = None) -> list[str] | None:
    """The UUIDs of CUDA devices `devices` (numbers as a process with `env`'s CUDA_VISIBLE_DEVICES
    counts them, which rlslurm runs under CUDA_DEVICE_ORDER=PCI_BUS_ID: NVML's order); None when it
    cannot be told (no nvidia-smi, another device order, an entry nvidia-smi does not list)."""
    env = os.environ if env is None else env
    if env.get("CUDA_DEVICE_ORDER", "PCI_BUS_ID") != "PCI_BUS_ID":
        return None
    table = _nvidia_smi()
    by_index = {i: normal_uuid(u) for i, u, _ in table}
    known = {normal_uuid(u) for _, u, _ in table}
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    entries = [e.strip() for e in cvd.split(",") if e.strip()] if cvd is not None else [i for i, _, _ in table]
    out = []
    for d in devices:
        if d >= len(entries):
            return None
        e = entries[d]
        u = by_index.get(e) if e.isdigit() else (normal_uuid(e) if normal_uuid(e) in known else None)
        if u is None:
            return None
        out.append(u)
    return out


def visible_gpu_uuids() -> list[str] | None:
    """The UUIDs of every GPU this process sees, in its device order (for its env report)."""
    return device_uuids(list(range(len(visible_gpus()))))


def torch_device_uuid(index: int) -> str | None:
    """The UUID of this process's CUDA device `index`, from the driver (torch)."""
    try:
        import torch

        return normal_uuid(str(torch.cuda.get_device_properties(index).uuid))
    except Exception:  # an old torch without .uuid, or no CUDA
        return None
