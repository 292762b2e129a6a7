"""The trainer's two parallel grids as megatron-core 0.16 builds them (docs/parallel-layouts.md,
"Experts have a grid of their own"), for everything that must agree with it: submit's checks
(rlslurm/resolve.py), the trainer's start (trainer/setup.py), the converter (convert/runtime.py) and
who takes part in an HF export (convert/parallel.py).

`parallel_state.initialize_model_parallel` splits the same world twice, both in megatron's default
rank order "tp-cp-ep-dp-pp" (fastest first):

- dense layers:  TP x CP x DP x PP            (DP = world / (TP x CP x PP))
- routed experts: ETP x EP x expert-DP x PP   (expert-DP = world / (ETP x EP x PP))

ETP (`expert_tensor_parallel_size`) defaults to TP; world must be a multiple of ETP x EP x PP or
megatron raises at start.
"""

from __future__ import annotations

import math

from rlslurm.errors import ConfigError

# megatron-core TransformerConfig fields that rlslurm's own flags set, in initialize_model_parallel
# and the TransformerConfig alike: a --megatron-<field> value would change the model's view only
# and disagree with the process groups.
OWNED_MEGATRON_FIELDS = {
    "tensor_model_parallel_size": "--tensor-model-parallel-size",
    "pipeline_model_parallel_size": "--pipeline-model-parallel-size",
    "context_parallel_size": "--context-parallel-size",
    "expert_model_parallel_size": "--expert-model-parallel-size",
    "expert_tensor_parallel_size": "--expert-tensor-parallel-size",
}


def owned_field_refusal(key: str) -> str | None:
    """Why `--megatron-<key>` is refused (a parallel size rlslurm's own flag sets), or None."""
    flag = OWNED_MEGATRON_FIELDS.get(key)
    if flag is None:
        return None
    return (f"--megatron-{key.replace('_', '-')}: rlslurm sets it from {flag} (the process groups and the "
            f"model must agree): use {flag}")


def check_expert_grid(world: int, *, tp: int, pp: int, ep: int, etp: int, where: str) -> None:
    """megatron-core's expert grid rule: ETP x EP x PP must divide the world (`where` names it:
    "the 8 trainer GPUs"). One line naming the flags."""
    grid = etp * ep * pp
    if world % grid:
        etp_said = (f"--expert-tensor-parallel-size {etp}" if etp != tp else
                    f"--expert-tensor-parallel-size {etp} (default: --tensor-model-parallel-size)")
        raise ConfigError(f"--expert-model-parallel-size {ep} x {etp_said} x --pipeline-model-parallel-size {pp} "
                          f"= {grid} does not divide {where}")


def exporting_dp_ranks(*, tp: int, cp: int, ep: int, etp: int) -> int:
    """How many dense data-parallel ranks (the first ones) of each pipeline stage take part in an HF
    export (convert/export.py `mcore_to_hf`), so that every gather it makes has all its members.

    The export gathers dense tensors over TP and routed experts over ETP, then over EP. In a stage,
    local rank i = tp + TP x (cp + CP x dp) (dense) = etp + ETP x (ep + EP x edp) (experts), so a
    dense TP group is an aligned block of TP x CP consecutive ranks (CP = 1 in the trainer) and an
    expert ETP x EP group one of ETP x EP. The ranks of DP 0 ([0, TP x CP)) pull in the blocks they
    touch, which pull in theirs: the smallest set closed under both is [0, lcm(TP x CP, ETP x EP)),
    i.e. the first lcm / (TP x CP) dense DP ranks. With ETP = TP that is EP (the EP group spans dense
    DP ranks); with ETP x EP dividing TP, DP 0 alone."""
    dense = tp * cp
    return math.lcm(dense, etp * ep) // dense


def converter_world(*, tp: int, pp: int, ep: int, etp: int) -> int:
    """The converter's process count (rlslurm/convert/runtime.py): the fewest ranks on which both
    grids fit, PP x lcm(TP, ETP x EP); TP x PP x EP when ETP = TP."""
    return pp * math.lcm(tp, etp * ep)
