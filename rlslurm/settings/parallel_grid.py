"""The trainer's two parallel grids as megatron-core 0.16 builds them (docs/parallel-layouts.md,
"Experts have a grid of their own"), and how it splits the layers over pipeline stages ("Pipeline
stages"), for everything that must agree with it: submit's checks (rlslurm/resolve.py), the
trainer's start (trainer/setup.py), the converter (convert/runtime.py) and who takes part in an HF
export (convert/parallel.py).

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
    "num_layers_in_first_pipeline_stage": "--decoder-first-pipeline-num-layers",
    "num_layers_in_last_pipeline_stage": "--decoder-last-pipeline-num-layers",
}
# megatron-core's other ways to split the layers over the stages: not modelled by `stage_layers`,
# and TransformerConfig.__post_init__ refuses each of them beside the first/last-stage counts
OTHER_PIPELINE_SPLITS = ("pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
                         "account_for_loss_in_pipeline_split")
FIRST_FLAG, LAST_FLAG = "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"


# megatron-core TransformerConfig fields that rlslurm's own flags set for the layer spec and the config
# alike (rlslurm/settings/transformer_impl.py)
OWNED_SPEC_FIELDS = {"transformer_impl": "--transformer-impl"}


def owned_field_refusal(key: str) -> str | None:
    """Why `--megatron-<key>` is refused (a field rlslurm's own flag sets), or None."""
    if key in OWNED_SPEC_FIELDS:
        flag, why = OWNED_SPEC_FIELDS[key], "the layer spec and the config must agree"
    elif key in OWNED_MEGATRON_FIELDS:
        flag, why = OWNED_MEGATRON_FIELDS[key], "the process groups and the model must agree"
    else:
        return None
    return f"--megatron-{key.replace('_', '-')}: rlslurm sets it from {flag} ({why}): use {flag}"


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


def stage_layers(num_layers: int, pp: int, first: int | None = None, last: int | None = None, *,
                 model: str = "the model", pp_flag: str = "--pipeline-model-parallel-size") -> list[int]:
    """The transformer layers of each pipeline stage, megatron-core 0.16.1's rule
    (transformer_block.py `get_num_layers_to_build`, transformer_layer.py
    `get_transformer_layer_offset`): the first (last) stage holds `first` (`last`) layers when given
    (slime's --decoder-first/last-pipeline-num-layers, TransformerConfig
    num_layers_in_first/last_pipeline_stage) and the other stages share the rest equally; stage s
    starts at global layer sum(stage_layers(...)[:s]). Refusals (ConfigError, one line naming the
    flags, `pp_flag` the PP one, and `model`) are those megatron makes at build or start, so a layout
    refused here never reaches it."""
    theirs = f"{model}'s {num_layers} layers"
    said = ([f"{FIRST_FLAG} {first}"] if first is not None else []) + \
           ([f"{LAST_FLAG} {last}"] if last is not None else [])
    if not said:
        if num_layers % pp:
            raise ConfigError(f"{pp_flag} {pp} does not divide {theirs} "
                              f"(give the first/last stage's layers: {FIRST_FLAG} / {LAST_FLAG})")
        return [num_layers // pp] * pp
    if pp < 2:  # slime asserts it too (slime/backends/megatron_utils/arguments.py)
        raise ConfigError(f"{' and '.join(said)}: needs {pp_flag} > 1")
    for flag, v in ((FIRST_FLAG, first), (LAST_FLAG, last)):
        if v is not None and v < 1:
            raise ConfigError(f"{flag} {v}: must be >= 1")
    middle_stages = pp - len(said)
    middle_layers = num_layers - (first or 0) - (last or 0)
    layout = f"{' and '.join(said)} at {pp_flag} {pp}"
    if middle_layers < 0 or (middle_stages == 0 and middle_layers) or (middle_stages and middle_layers < middle_stages):
        raise ConfigError(f"{layout}: the {middle_stages} other stage{'s' if middle_stages != 1 else ''} would hold "
                          f"{middle_layers} of {theirs}; every stage needs >= 1 layer and every layer a stage")
    if middle_stages and middle_layers % middle_stages:
        raise ConfigError(f"{layout}: the {middle_stages} other stages would share {middle_layers} of {theirs}, "
                          "which does not divide evenly")
    per = middle_layers // middle_stages if middle_stages else 0
    return ([first] if first is not None else []) + [per] * middle_stages + ([last] if last is not None else [])


def check_pipeline_split(overrides, pp: int) -> None:
    """Refused at PP > 1: the interleaved schedule (virtual pipeline stages), since the RL loop
    (trainer/pipeline.py) runs megatron's 1F1B schedule on one model chunk; and megatron-core's other
    layer splits (OTHER_PIPELINE_SPLITS, given as --megatron-*), which it refuses beside the
    first/last-stage counts (TransformerConfig.__post_init__, "Uneven PP" and "PP layout") and which
    `stage_layers` does not model."""
    if pp < 2:
        return
    if overrides.get("virtual_pipeline_model_parallel_size"):
        raise ConfigError("--megatron-virtual-pipeline-model-parallel-size: the interleaved schedule (several "
                          "model chunks per stage) is not supported by the RL trainer loop")
    for key in OTHER_PIPELINE_SPLITS:
        if overrides.get(key):
            raise ConfigError(f"--megatron-{key.replace('_', '-')}: rlslurm splits the layers over pipeline stages "
                              f"evenly or by {FIRST_FLAG} / {LAST_FLAG} (rlslurm/settings/parallel_grid.py); "
                              "megatron-core's other splits are not supported")


def check_gated_delta_net(arch, name: str, *, tp: int, qkv_format: str = "bshd") -> None:
    """What megatron-core 0.16's GatedDeltaNet (Qwen3-Next's linear-attention layers) cannot do,
    refused in one line at submit (rlslurm/resolve.py) and when the trainer builds the model
    (models/build.py): packed sequences (GatedDeltaNet.forward raises NotImplementedError for
    packed_seq_params), and TP that does not split the key and value heads (transformer_config.py
    asserts it). Context parallelism is rlslurm's (models/gated_delta.py) and not limited here."""
    d = getattr(arch, "gated_delta_net", None)
    if d is None:
        return
    if qkv_format == "thd":
        raise ConfigError(f"--qkv-format thd: {name}'s gated delta net layers take no packed sequences "
                          "(megatron-core 0.16 GatedDeltaNet.forward raises NotImplementedError)")
    if d.num_key_heads % tp or d.num_value_heads % tp:
        raise ConfigError(f"--tensor-model-parallel-size {tp}: {name}'s gated delta net layers have "
                          f"{d.num_key_heads} key / {d.num_value_heads} value heads, which do not split into {tp}")
