"""One machine's GPUs between the two groups: `rlslurm run` and a `--nodes 1` SLURM job
(docs/single-node.md). Each group gets its own GPUs, as the het job gives each group its own nodes."""

from __future__ import annotations

import os
import subprocess
from typing import TYPE_CHECKING

from rlslurm.errors import ConfigError

if TYPE_CHECKING:
    from rlslurm.config import RunConfig


def visible_gpus() -> list[str]:
    """The GPUs this process may use: CUDA_VISIBLE_DEVICES if set, else every GPU nvidia-smi lists."""
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return [g for g in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def split_gpus(visible: list[str], trainer: int, rollout: int,
               flags: tuple[str, str] = ("--trainer-procs-per-node", "--gpus-per-node")) -> tuple[list[str], list[str]]:
    """As the het job gives each group its own nodes, one machine gives each group its own GPUs: the
    trainer the first `trainer`, the rollout's engines the next `rollout`. Each group's list is its
    CUDA_VISIBLE_DEVICES: its own GPUs first (so it numbers them from 0, exactly as on its own node),
    then every other GPU of the machine, so that NCCL between the groups may use the peer GPU directly.
    Hiding the others works too (tools/gpu/nccl_pair_check.py passed both on 2xH200, docs/gpu.md)."""
    if len(visible) < trainer + rollout:
        raise ConfigError(f"--device cuda: the trainer ({trainer} GPU(s), {flags[0]}) and the rollout engines "
                          f"({rollout}, {flags[1]}) need {trainer + rollout} GPUs, {len(visible)} visible on this machine")
    own_t, own_r = visible[:trainer], visible[trainer:trainer + rollout]
    return (own_t + [g for g in visible if g not in own_t], own_r + [g for g in visible if g not in own_r])


def shared_gpus(visible: list[str], need: int) -> tuple[list[str], list[str]]:
    """--shared-gpu: the trainer and the engines each number the same GPUs from 0."""
    if len(visible) < need:
        raise ConfigError(f"rlslurm run --shared-gpu: the trainer and the engines share {need} GPU(s) "
                          f"(the larger of --trainer-procs-per-node and --gpus-per-node), {len(visible)} visible")
    return list(visible), list(visible)


def group_gpus(cfg: "RunConfig") -> tuple[list[str], list[str]] | None:
    """(trainer's, rollout's) CUDA_VISIBLE_DEVICES on one machine: `rlslurm run`, and a `--nodes 1`
    SLURM job's two steps (rlslurm/slurm/launch.py; each step sees every GPU of the job, the batch
    script starts both with --overlap). None on --device cpu."""
    if cfg.run.device != "cuda":
        return None
    from rlslurm.rollout.main import no_engines_reason

    # A run without engines (a replay of another run's buffer) needs GPUs for the trainer only.
    engines = 0 if no_engines_reason(cfg) else cfg.rollout_gpus_per_node
    if cfg.shares_gpus:  # both groups on the same GPUs (weight sync over gloo, resolve.py)
        return shared_gpus(visible_gpus(), max(cfg.trainer_procs_per_node, engines))
    return split_gpus(visible_gpus(), cfg.trainer_procs_per_node, engines, cfg.gpu_split_flags)


def step_gpus(cfg: "RunConfig", role: str) -> str | None:
    """--nodes 1 in SLURM: the role's CUDA_VISIBLE_DEVICES, picked from the job's GPUs that both
    overlapping steps see (the same split as `rlslurm run`). None where SLURM's own is right: a het
    group's node belongs to its role alone."""
    s = cfg.slurm
    if not cfg.single_node or not s.trainer_gpus:
        return None
    trainer, rollout = split_gpus(visible_gpus(), s.trainer_gpus, s.rollout_gpus or 0, cfg.gpu_split_flags)
    return ",".join(trainer if role == "trainer" else rollout)
