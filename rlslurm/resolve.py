"""Turn flags + YAML + model defaults into one validated `RunConfig`.

`resolve()` is the only place a config is assembled; the CLI (`submit`, `render`, `run`) calls
it and nothing is submitted unless it passes. Cross-field checks name the flags involved.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from pydantic import ValidationError

from rlslurm import preflight
from rlslurm.engines.memory_share import check_given_share
from rlslurm.engines.sglang_flags import check_parallel
from rlslurm.errors import ConfigError
from rlslurm.models.model_from_hf import run_model
from rlslurm.settings import layout
from rlslurm.settings.config import RunConfig, TrainSection
from rlslurm.settings.eval_config import eval_datasets
from rlslurm.settings.flags import FIELDS, Layer, build_config, flag_name, load_yaml_layer, parse_flags
from rlslurm.settings.low_precision import (
    StoredPrecision,
    check_engine_quantization,
    check_int4_engine_args,
    check_megatron_precision,
    stored_precision,
)
from rlslurm.settings.model_config import ModelConfig, model_config_path
from rlslurm.settings.parallel_grid import (
    check_expert_grid,
    check_gated_delta_net,
    check_pipeline_split,
    owned_field_refusal,
    stage_layers,
)
from rlslurm.settings.paths import PLUGIN_FIELDS, absolute, absolutize, is_file_plugin, model_download_hint
from rlslurm.settings.placeholder import check_filled
from rlslurm.settings.prompt_slice import parse_prompt_spec
from rlslurm.settings.rl_settings import check_rl_settings
from rlslurm.settings.rm_types import RM_REGISTRY
from rlslurm.settings.sparse_attention import sparse_attention_refusal
from rlslurm.settings.timespec import time_limit_s
from rlslurm.settings.weight_plan import auto_receiver
from rlslurm.trainer.replay_subsample import check_subsample

# Adam + fp32 master weights + grads, bf16 params: bytes per parameter before sharding.
_TRAIN_BYTES_PER_PARAM = 18


@dataclass
class Resolved:
    cfg: RunConfig
    model: ModelConfig
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)   # facts of the run worth one line at submit

    @cached_property
    def stored(self) -> StoredPrecision:
        """--hf-checkpoint's quantization, read once (its config.json; settings/low_precision.py)."""
        return stored_precision(self.cfg.model.hf_checkpoint)


def resolve(argv: list[str], config_file: Path | None = None, *, strict_inputs: bool = True) -> Resolved:
    """`strict_inputs=False` (dry runs) turns missing prompt data / checkpoint into warnings.

    Every path of the result is absolute (rlslurm/settings/paths.py says against what)."""
    cli = parse_flags(argv)
    check_filled(cli)  # before any value is read: import-slime's `<unset NAME>` is named, never parsed
    user_layers = [absolutize(cli, Path.cwd())]
    if config_file:
        file_layer = load_yaml_layer(config_file)
        check_filled(file_layer)
        user_layers.insert(0, absolutize(file_layer, config_file.parent))
    # The model and node count pick the defaults layer, so read them from the user layers first.
    probe = build_config(user_layers)
    if not probe.run.colocate and not probe.single_node:
        _split_rest(probe.slurm)  # a wrong split is the user's first problem, whatever the model
    mc = run_model(probe.model.model, probe.model.hf_checkpoint)
    defaults = Layer()
    source = model_config_path(probe.model.model) if probe.model.model else f"{probe.model.hf_checkpoint}/config.json"
    where = f"{source} (defaults for {probe.slurm.nodes} nodes)"
    split = ("trainer_nodes", "rollout_nodes")
    user_split = any(("slurm", n) in layer.values for layer in user_layers for n in split)
    lent = mc.defaults_for(probe.slurm.nodes)
    user_device = any(("run", "device") in layer.values for layer in user_layers)
    device = probe.run.device if user_device else lent.get("device", probe.run.device)
    for name, value in lent.items():
        if name not in FIELDS:
            raise ConfigError(f"{where}: unknown setting {name!r}")
        if name in split and (user_split or probe.run.colocate):
            continue  # the user chose one side of the split (the other is the rest), or there is none
        if name == "trainer_procs_per_node" and device == "cuda" and (probe.run.colocate or probe.slurm.nodes == 1):
            continue  # the placement gives the trainer its GPUs (layout.py); a config's CPU process count does not
        if name in CPU_PLACEMENT and device == "cuda" and lent.get("device") == "cpu":
            continue  # a config's placement on CPU cores (a tiny model's) is not one on GPUs
        defaults.set(name, value, where)
    if device == "cuda":
        defaults.megatron.update(_megatron_defaults(mc.megatron, user_layers))
    cfg = build_config([defaults, *user_layers])
    user_set = {name for layer in user_layers for _, name in layer.values}
    _sft_batch(cfg, user_set)
    res = Resolved(cfg, mc)
    _rollouts_from_epochs(res, user_set)
    try:
        _derive(res)
        _check(res, strict_inputs)
    except ValidationError as e:  # a derived value out of its field's bounds: one line, never a traceback
        err = e.errors()[0]
        name = str(err["loc"][-1]) if err["loc"] else "config"
        raise ConfigError(f"{flag_name(name)}: derived value {err.get('input')!r} is refused: "
                          f"{err['msg'].removeprefix('Value error, ')}") from None
    return res


# A model config's defaults that place processes on CPU cores (the tiny models' `device: cpu` entries):
# with --device cuda the GPUs place them (--gpus-per-node and the layout), not these.
CPU_PLACEMENT = frozenset({"gpus_per_node", "trainer_procs_per_node", "engines_per_node"})


def _megatron_defaults(model: dict, user_layers: list[Layer]) -> dict:
    """The model config's megatron-core settings the user did not set. recompute_method and
    recompute_num_layers belong to full recompute only (megatron-core refuses them beside
    `selective`), so they stay only while the granularity is still `full`."""
    user = {k: v for layer in user_layers for k, v in layer.megatron.items()}
    out = {k: v for k, v in model.items() if k not in user}
    if user.get("recompute_granularity", model.get("recompute_granularity")) != "full":
        out = {k: v for k, v in out.items() if k not in ("recompute_method", "recompute_num_layers")}
    return out


def _split_rest(s) -> int | None:
    """The nodes left for the side of the trainer/rollout split the user did not give (None when both
    or neither are given). Checked before the assignment, whose pydantic bound (>= 1) would otherwise
    surface as a traceback."""
    if (s.trainer_nodes is None) == (s.rollout_nodes is None):
        return None
    given, n = ("--trainer-nodes", s.trainer_nodes) if s.rollout_nodes is None else ("--rollout-nodes", s.rollout_nodes)
    if s.nodes - n < 1:
        other = "--rollout-nodes" if given == "--trainer-nodes" else "--trainer-nodes"
        raise ConfigError(f"{given} {n} with --nodes {s.nodes} leaves no node for {other} (the rest of --nodes): "
                          f"give --nodes {n + 1} or more")
    return s.nodes - n


def _is_sft(cfg: RunConfig) -> bool:
    """SFT rollouts (rollout/sft.py): named, slime's spelling, or --debug-train-only's default."""
    from rlslurm.rollout.sft import SFT_ROLLOUT_FN, SLIME_SFT_ROLLOUT_FN

    fn = cfg.rollout.rollout_function_path
    return fn in (SFT_ROLLOUT_FN, SLIME_SFT_ROLLOUT_FN) or (cfg.builds_without_engines and not fn)


def _sft_batch(cfg: RunConfig, user_set: set[str]) -> None:
    """SFT has one sample per conversation (rollout/sft.py refuses more): --n-samples-per-prompt defaults
    to 1 there, as it does everywhere in slime (slime/utils/arguments.py: default=1), not to rlslurm's
    GRPO group of 8; a global batch the model's defaults gave for groups of 8 is derived again from
    the rollout batch. The user's values win."""
    if not _is_sft(cfg) or "n_samples_per_prompt" in user_set:
        return
    cfg.rollout.n_samples_per_prompt = 1
    if "global_batch_size" not in user_set:
        cfg.train.global_batch_size = None


def _rollouts_from_epochs(res: Resolved, user_set: set[str]) -> None:
    """slime's --num-epoch without --num-rollout: as many rollouts as the epochs take, records //
    --rollout-batch-size per epoch (slime/ray/rollout.py `get_num_rollout_per_epoch`, times num_epoch in
    slime/ray/placement_group.py); the dry run says how many steps that is. With --num-rollout given,
    --num-epoch caps the prompts' passes instead (_check_prompt_supply), as slime ignores it then."""
    from rlslurm.rollout.prompt_records import count_records

    cfg = res.cfg
    d, r = cfg.data, cfg.rollout
    if d.num_epoch is None or "num_rollout" in user_set or cfg.train.load_debug_rollout_data is not None:
        return
    how = f"--num-epoch {d.num_epoch} without --num-rollout: as many rollouts as the epochs take"
    if d.prompt_data is None or not parse_prompt_spec(d.prompt_data).path.exists():
        res.notes.append(f"{how}, which follows from --prompt-data's records (not here: --num-rollout "
                         f"{r.num_rollout} stands in this dry run)")
        return
    n = count_records(d.prompt_data)
    if n is None:
        raise ConfigError(f"{how}, but --prompt-data {d.prompt_data} is too large to count at submit: pass "
                          f"--num-rollout (its records // --rollout-batch-size {r.rollout_batch_size} x {d.num_epoch})")
    per_epoch = n // r.rollout_batch_size
    if per_epoch < 1:
        raise ConfigError(f"{how}: --prompt-data {d.prompt_data} has {n} records, fewer than one --rollout-batch-size "
                          f"{r.rollout_batch_size}, so not one rollout per epoch")
    r.num_rollout = per_epoch * d.num_epoch
    res.notes.append(f"--num-epoch {d.num_epoch}: --prompt-data's {n} records // --rollout-batch-size "
                     f"{r.rollout_batch_size} = {per_epoch} rollouts per epoch, so --num-rollout {r.num_rollout}: "
                     f"{r.num_rollout * cfg.train.num_steps_per_rollout} training steps (slime's rule)")


def _derive(res: Resolved) -> None:
    cfg = res.cfg
    s = cfg.slurm
    layout.place_groups(cfg)
    if s.trainer_nodes is None and s.rollout_nodes is None:
        s.trainer_nodes = max(1, s.nodes // 2)
    rest = _split_rest(s)
    if s.trainer_nodes is None:
        s.trainer_nodes = rest
    if s.rollout_nodes is None:
        s.rollout_nodes = rest
    r, t = cfg.rollout, cfg.train
    if t.global_batch_size is None:
        samples = r.rollout_batch_size * r.n_samples_per_prompt
        if samples % t.num_steps_per_rollout:
            raise ConfigError(
                f"--rollout-batch-size {r.rollout_batch_size} x --n-samples-per-prompt {r.n_samples_per_prompt} = "
                f"{samples} "
                f"samples cannot be split into --num-steps-per-rollout {t.num_steps_per_rollout} equal steps"
            )
        t.global_batch_size = samples // t.num_steps_per_rollout
    if t.use_distributed_optimizer is None:
        # Megatron practice: shard Adam state over data parallelism whenever there is any (resume is
        # bit-exact with it, tests/trainer/test_trainer_resume.py); with DP=1 it only adds copies.
        mp = t.tensor_model_parallel_size * t.pipeline_model_parallel_size * t.context_parallel_size
        t.use_distributed_optimizer = cfg.trainer_gpus // mp > 1
    if t.update_weight_receiver == "auto":  # kept settled in run.yaml: what ran is what it names
        t.update_weight_receiver = auto_receiver(cfg.run.device, res.model.hf_model_type, cfg.shares_gpus,
                                                 quantized=res.stored.quantized)
    if cfg.run.run_dir is None:  # the default, ./runs/<name>, is relative to where submit runs
        cfg.run.run_dir = Path(absolute(cfg.run_dir, Path.cwd()))
    if s.python is None:
        import sys

        s.python = sys.executable
    if cfg.run.use_wandb and cfg.run.wandb_run_id is None:
        cfg.run.wandb_run_id = preflight.wandb_run_id(cfg.run.run_name, cfg.run_dir)
    from rlslurm.rollout.sft import SFT_ROLLOUT_FN, SLIME_SFT_ROLLOUT_FN

    if r.rollout_function_path == SLIME_SFT_ROLLOUT_FN or (cfg.builds_without_engines and not r.rollout_function_path):
        r.rollout_function_path = SFT_ROLLOUT_FN  # slime's SFT rollout is rlslurm's rollout/sft.py


def _check(res: Resolved, strict_inputs: bool) -> None:
    """Every check of a derived config, one concern a function, in the order a user meets their errors."""
    cfg, mc = res.cfg, res.model
    _check_batch_identity(cfg)
    _check_nodes_and_time(cfg)
    if (why := layout.context_parallel_refusal(cfg, mc)) is not None:
        raise ConfigError(why)
    t = cfg.train
    if (why := sparse_attention_refusal(mc, qkv_format=t.qkv_format, megatron=cfg.megatron,
                                        transformer_impl=t.transformer_impl,
                                        pp=t.pipeline_model_parallel_size, first=t.decoder_first_pipeline_num_layers,
                                        last=t.decoder_last_pipeline_num_layers)) is not None:
        raise ConfigError(why)  # GLM-5 (rlslurm/settings/sparse_attention.py)
    if cfg.run.shared_gpu:
        _check_shared_gpu(cfg)
    dp = _check_trainer_grid(cfg, mc)
    _check_rank_batches(cfg.train, dp)
    _check_engines(cfg)
    check_rl_settings(cfg.train, cfg.model)  # every rule across RL settings; the trainer re-runs it
    _check_train_only(cfg)
    _check_rollout_only(cfg)
    _check_cpu_offload(cfg)
    _check_rollout(cfg)
    _check_timeouts(cfg.train)
    _check_packages(res, strict_inputs)
    _check_run_dir(cfg)
    _check_inputs(res, strict_inputs)
    _check_memory(res)


def _check_batch_identity(cfg: RunConfig) -> None:
    r, t = cfg.rollout, cfg.train
    assert t.global_batch_size is not None
    samples = r.rollout_batch_size * r.n_samples_per_prompt
    if samples != t.global_batch_size * t.num_steps_per_rollout:
        raise ConfigError(
            "batch identity violated: --rollout-batch-size x --n-samples-per-prompt "
            f"({r.rollout_batch_size} x {r.n_samples_per_prompt} = {samples}) must equal "
            f"--global-batch-size x --num-steps-per-rollout ({t.global_batch_size} x {t.num_steps_per_rollout} "
            f"= {t.global_batch_size * t.num_steps_per_rollout})"
        )


def _check_nodes_and_time(cfg: RunConfig) -> None:
    """Where the groups run (layout.py) and the job's time limit."""
    s = cfg.slurm
    assert s.trainer_nodes is not None and s.rollout_nodes is not None
    layout.check(cfg)
    if not cfg.single_node and not cfg.run.colocate and s.trainer_nodes + s.rollout_nodes != s.nodes:
        raise ConfigError(
            f"--trainer-nodes {s.trainer_nodes} + --rollout-nodes {s.rollout_nodes} = "
            f"{s.trainer_nodes + s.rollout_nodes}, but --nodes is {s.nodes}"
        )
    if s.trainer_nodes < 1 or s.rollout_nodes < 1:
        raise ConfigError(f"--nodes {s.nodes}: the trainer and the rollout group need at least one node each")
    limit = time_limit_s(s.time)
    if limit is not None and limit < 2 * s.signal_grace_s:
        # USR1 would come (almost) at once, and preemption requeues are not failures: it would requeue forever
        raise ConfigError(
            f"--time {s.time} ({limit} s) must be at least twice --signal-grace-s {s.signal_grace_s}: USR1 comes "
            f"that long before the limit to checkpoint and requeue, so the job would do little or no work per attempt"
        )


def _check_trainer_grid(cfg: RunConfig, mc: ModelConfig) -> int:
    """TP x PP x CP over the trainer's GPUs, the experts' grid and the layers' stages, as megatron-core
    builds them for this model; returns the data-parallel size."""
    s, t = cfg.slurm, cfg.train
    for key in cfg.megatron:
        if (why := owned_field_refusal(key)) is not None:
            raise ConfigError(why)
    world = cfg.trainer_gpus
    mp = t.tensor_model_parallel_size * t.pipeline_model_parallel_size * t.context_parallel_size
    if world % mp:
        raise ConfigError(
            f"--tensor-model-parallel-size {t.tensor_model_parallel_size} x --pipeline-model-parallel-size "
            f"{t.pipeline_model_parallel_size} x --context-parallel-size {t.context_parallel_size} = {mp} does not "
            f"divide the {world} trainer GPUs (--trainer-nodes {s.trainer_nodes} x {cfg.trainer_procs_per_node} "
            "per node)"
        )
    if t.expert_model_parallel_size > 1:
        if mc.arch.moe is None:
            raise ConfigError(f"--expert-model-parallel-size {t.expert_model_parallel_size}: {mc.name} has no experts")
        if mc.arch.moe.num_experts % t.expert_model_parallel_size:
            raise ConfigError(
                f"--expert-model-parallel-size {t.expert_model_parallel_size} does not divide "
                f"{mc.name}'s {mc.arch.moe.num_experts} experts"
            )
    # megatron-core builds the experts' grid (ETP x EP x expert-DP x PP) over the same world, whether
    # or not the model has experts (rlslurm/settings/parallel_grid.py, docs/parallel-layouts.md)
    check_expert_grid(world, tp=t.tensor_model_parallel_size, pp=t.pipeline_model_parallel_size,
                      ep=t.expert_model_parallel_size, etp=t.expert_tp,
                      where=f"the {world} trainer GPUs")
    if mc.arch.moe is not None and mc.arch.moe.moe_ffn_hidden_size % t.expert_tp:
        raise ConfigError(f"--expert-tensor-parallel-size {t.expert_tp} does not divide {mc.name}'s expert FFN "
                          f"width {mc.arch.moe.moe_ffn_hidden_size} (arch.moe.moe_ffn_hidden_size): each expert's "
                          "FFN is split over ETP ranks")
    tp = t.tensor_model_parallel_size
    if mc.arch.num_attention_heads % tp or mc.arch.num_query_groups % tp:
        if not (mc.arch.mla and mc.arch.num_attention_heads % t.tensor_model_parallel_size == 0):
            raise ConfigError(
                f"--tensor-model-parallel-size {t.tensor_model_parallel_size} must divide {mc.name}'s "
                f"{mc.arch.num_attention_heads} heads and {mc.arch.num_query_groups} query groups"
            )
    check_gated_delta_net(mc.arch, mc.name, tp=t.tensor_model_parallel_size, qkv_format=t.qkv_format)
    # megatron-core's split of the layers over the stages, even or uneven (rlslurm/settings/parallel_grid.py)
    stage_layers(mc.arch.num_layers, t.pipeline_model_parallel_size, t.decoder_first_pipeline_num_layers,
                 t.decoder_last_pipeline_num_layers, model=mc.name)
    check_pipeline_split(cfg.megatron, t.pipeline_model_parallel_size)
    return world // mp


def _check_rank_batches(t: TrainSection, dp: int) -> None:
    """Each optimizer step's samples split evenly over the data-parallel ranks and their micro-batches."""
    assert t.global_batch_size is not None
    if t.global_batch_size % dp:
        raise ConfigError(f"--global-batch-size {t.global_batch_size} is not divisible by the data-parallel size {dp}")
    if not t.use_dynamic_batch_size and (t.global_batch_size // dp) % t.micro_batch_size:
        raise ConfigError(
            f"--global-batch-size {t.global_batch_size} / data-parallel size {dp} = {t.global_batch_size // dp} "
            f"samples per rank is not a multiple of --micro-batch-size {t.micro_batch_size}"
        )
    if t.use_dynamic_batch_size and not t.max_tokens_per_gpu:
        raise ConfigError("--use-dynamic-batch-size needs --max-tokens-per-gpu")


def _check_engines(cfg: RunConfig) -> None:
    """The engines' GPUs (or CPU ranks), their SGLang parallelism and the ports of one spanning nodes."""
    s, r = cfg.slurm, cfg.rollout
    if cfg.run.device == "cuda":
        if s.gpus_per_node < 1:
            raise ConfigError("--gpus-per-node must be >= 1 with --device cuda")
        # one node: the rollout's share of it (--rollout-gpus); else every GPU of a rollout node
        per_node, per_node_flag = cfg.rollout_gpus_per_node, cfg.gpu_split_flags[1]
        if not cfg.starts_no_engines:
            _check_engine_size(cfg, r.rollout_num_gpus_per_engine, per_node, f"{per_node_flag} {per_node}")
    elif not r.engines_per_node and not cfg.starts_no_engines:
        raise ConfigError("--device cpu needs --engines-per-node (how many SGLang servers each rollout node runs)")
    elif r.rollout_num_gpus_per_engine > 1 and not cfg.starts_no_engines:
        # CPU: one rank per node (engines/span.py), the stand-in for GPU engines spanning nodes
        if r.engines_per_node != 1:
            raise ConfigError(f"--rollout-num-gpus-per-engine {r.rollout_num_gpus_per_engine} with --device cpu runs "
                              f"one rank of an engine on each of {r.rollout_num_gpus_per_engine} rollout nodes: it "
                              f"needs --engines-per-node 1, got {r.engines_per_node}")
        _check_engine_size(cfg, r.rollout_num_gpus_per_engine, 1, "one rank per node with --device cpu")
    if not cfg.starts_no_engines:
        check_parallel(preflight.sglang_passthrough(cfg), r.rollout_num_gpus_per_engine, preflight.sglang_table(cfg))
        _check_span_exposure(cfg)


def _check_rollout(cfg: RunConfig) -> None:
    """The reward model, the prompt length and the driver's group-loop settings."""
    r, d = cfg.rollout, cfg.data
    rm = RM_REGISTRY[r.rm_type]
    if rm.needs_url and not r.rm_url and not r.custom_rm_path:
        raise ConfigError(f"--rm-type {r.rm_type} needs --rm-url")
    if rm.dict_keys and not r.custom_rm_path and r.reward_key not in rm.dict_keys:
        raise ConfigError(f"--rm-type {r.rm_type} returns the scores {', '.join(rm.dict_keys)}: pick the trained one "
                          f"with --reward-key (slime's recipes use --reward-key {rm.dict_keys[0]}), "
                          f"got {r.reward_key!r}")
    ctx = r.rollout_max_context_len
    if ctx is not None and d.max_prompt_len is not None and d.max_prompt_len > ctx - 1:
        raise ConfigError(f"--max-prompt-len {d.max_prompt_len} must be < --rollout-max-context-len {ctx}: a prompt "
                          f"must leave room for at least one generated token")
    from rlslurm.rollout.rollout_fn import refuse_combinations

    refuse_combinations(r)  # the driver's group-loop flags with --rollout-function-path
    if r.over_sampling_batch_size is not None and r.over_sampling_batch_size < r.rollout_batch_size:
        raise ConfigError(
            f"--over-sampling-batch-size {r.over_sampling_batch_size} must be >= --rollout-batch-size "
            f"{r.rollout_batch_size}"
        )


def _check_timeouts(t: TrainSection) -> None:
    """The trainer's collective timeout outlasts rank 0's lone weight-sync phase; the watchdog outlasts both."""
    if t.distributed_timeout_minutes * 60 < min_distributed_timeout_s(t.weight_sync_timeout_s):
        raise ConfigError(
            f"--distributed-timeout-minutes {t.distributed_timeout_minutes:g} is shorter than rank 0 can spend alone "
            f"between two collectives with --weight-sync-timeout-s {t.weight_sync_timeout_s:g} "
            f"(at least {min_distributed_timeout_s(t.weight_sync_timeout_s) / 60:.1f} minutes)")
    if t.hang_timeout_minutes and t.hang_timeout_minutes <= t.distributed_timeout_minutes:
        raise ConfigError(
            f"--hang-timeout-minutes {t.hang_timeout_minutes:g} must be longer than --distributed-timeout-minutes "
            f"{t.distributed_timeout_minutes:g}: a rank may wait that long in a collective without a heartbeat "
            f"(0 turns the watchdog off)")


def _check_packages(res: Resolved, strict_inputs: bool) -> None:
    """The packages the job runs, against what is set for them: the supported stacks, wandb, SGLang (its
    flags, dtype and memory saver), sglang-router, megatron-core (its fields, its precision) and
    transformer-engine (--transformer-impl) (preflight.py)."""
    cfg, mc = res.cfg, res.model
    preflight.check_transformer_impl(cfg, res.warnings)  # before the stack: its reason is the precise one
    preflight.check_stack(cfg, mc, res.warnings, res.notes)
    preflight.check_wandb(cfg, res.warnings)
    preflight.check_sglang_args(cfg, res.warnings)
    engine_argv = preflight.sglang_passthrough(cfg).argv  # its --config file's keys too
    check_given_share(engine_argv)
    check_engine_quantization(engine_argv, res.stored.fp8_block is not None)
    if res.stored.int4 is not None:  # CUDA Marlin MoE, the form SGLang can reload
        check_int4_engine_args(engine_argv, cfg.run.device)
    preflight.check_engine_dtype(cfg)
    preflight.check_colocate(cfg, res.warnings, strict=strict_inputs)
    preflight.check_dsa_engine(cfg, mc, res.warnings, strict=strict_inputs)
    preflight.check_router_args(cfg, res.warnings)
    check_megatron_precision(cfg.megatron)  # FP8/FP4 training: refused with the reason (low_precision.py)
    preflight.check_megatron_fields(cfg, mc, res.warnings)
    from rlslurm.trainer.host_memory import submit_line  # page-locked host memory against --mem

    if (line := submit_line(cfg, mc)) is not None:
        res.warnings.append(line)


# Rank 0 alone, in one stretch between two trainer collectives: the wait for this attempt's engines
# (one weight-sync timeout), then a publish whose tries each take at most one timeout, plus slack
# for a checkpoint's finalisation (trainer/collectives.py).
SINGLE_RANK_WEIGHT_SYNC_TIMEOUTS = 4


def _check_shared_gpu(cfg: RunConfig) -> None:
    """--shared-gpu: the trainer and the engines are separate processes on the same GPU(s) (docs/gpu.md)."""
    if cfg.run.device != "cuda":
        raise ConfigError("--shared-gpu shares GPUs between the trainer and the engines: it needs --device cuda")
    if cfg.train.weight_sync_backend == "nccl":
        raise ConfigError("--shared-gpu with --weight-sync-backend nccl: NCCL refuses two ranks on one GPU (the "
                          "trainer and an engine); leave it auto (gloo) or use gloo")


def _check_cpu_offload(cfg: RunConfig) -> None:
    """--megatron-optimizer-cpu-offload: megatron-core's HybridDeviceOptimizer runs inside its
    distributed optimizer, on the fp32 main copies that bf16/fp16 training makes; with fp32 weights
    those copies are views of the weights and megatron fails with "can't optimize a non-leaf Tensor"
    (measured, megatron-core 0.16; tests/trainer/test_trainer_resume.py trains and resumes it)."""
    if not cfg.megatron.get("optimizer_cpu_offload"):
        return
    if not cfg.train.use_distributed_optimizer:
        raise ConfigError("--megatron-optimizer-cpu-offload needs --use-distributed-optimizer (megatron-core offloads "
                          "the distributed optimizer's state)")
    if not (cfg.train.bf16 or cfg.megatron.get("fp16")):
        raise ConfigError("--megatron-optimizer-cpu-offload needs --bf16 (or --megatron-fp16): megatron-core offloads "
                          "the fp32 main copies of 16-bit weights, which fp32 training does not make")


def _check_rollout_only(cfg: RunConfig) -> None:
    """--debug-rollout-only (engines generate, nothing is trained: rlslurm/trainer/rollout_only.py)."""
    t = cfg.train
    if not t.debug_rollout_only:
        return
    if t.load_debug_rollout_data is not None:
        raise ConfigError("--debug-rollout-only (generate, train nothing) and --load-debug-rollout-data (train "
                          "from a buffer, generate nothing) exclude each other")
    if t.verify_weight_sync:
        raise ConfigError("--verify-weight-sync: --debug-rollout-only publishes no weights to verify")


def _check_span_exposure(cfg: RunConfig) -> None:
    """No engine whose nodes talk over SGLang's unauthenticated ZMQ ports on a routable address
    unless the user said where they bind or that they are closed (engines/span.py)."""
    from rlslurm.engines.span import span_exposure_refusal
    from rlslurm.rollout.node import nodes_per_engine

    r = cfg.rollout
    if (why := span_exposure_refusal(cfg.sglang_args, nodes_per_engine(cfg), r.engine_span_interface,
                                     r.engine_span_ports_closed, preflight.sglang_table(cfg))) is not None:
        raise ConfigError(why)
    if r.engine_span_interface is not None and not r.engine_span_interface.strip():
        raise ConfigError("--engine-span-interface: an empty interface name")


def _check_engine_size(cfg: RunConfig, tp: int, per_node: int, per_node_desc: str) -> None:
    """An engine fits in a node's rollout GPUs, or spans whole rollout nodes (engines/span.py)."""
    if tp <= per_node:
        if per_node % tp:
            raise ConfigError(f"--rollout-num-gpus-per-engine {tp} does not divide {per_node_desc}")
        return
    if cfg.single_node:
        raise ConfigError(f"--rollout-num-gpus-per-engine {tp} is more than {per_node_desc}, and with --nodes 1 "
                          "there is no other node for the engine to span")
    if tp % per_node:
        raise ConfigError(f"--rollout-num-gpus-per-engine {tp} is more than {per_node_desc} and not a multiple of "
                          "it: an engine spanning nodes uses every GPU of each node it spans")
    span, nodes = tp // per_node, cfg.slurm.rollout_nodes or 1
    if nodes % span:
        raise ConfigError(f"--rollout-num-gpus-per-engine {tp} spans {span} rollout nodes ({per_node_desc}), "
                          f"but --rollout-nodes {nodes} is not a multiple of {span}")


def _check_train_only(cfg: RunConfig) -> None:
    """--debug-train-only (no engines) and the SFT rollouts it builds (rlslurm/rollout/sft.py)."""
    from rlslurm.rollout.sft import SFT_ROLLOUT_FN

    r, t, d = cfg.rollout, cfg.train, cfg.data
    if r.rollout_function_path == SFT_ROLLOUT_FN and not t.debug_train_only:
        raise ConfigError(f"--rollout-function-path {SFT_ROLLOUT_FN} builds SFT rollouts without engines: add "
                          "--debug-train-only (else engines start and the trainer publishes to them for nothing)")
    if t.debug_train_only and t.debug_rollout_only:
        raise ConfigError("--debug-train-only (no engines) and --debug-rollout-only (no training) exclude each other")
    if not cfg.builds_without_engines:
        return
    flag = "--debug-train-only"
    if r.rollout_function_path == SFT_ROLLOUT_FN:
        if r.n_samples_per_prompt != 1:
            raise ConfigError(f"{flag}: SFT rollouts have one sample per conversation: --n-samples-per-prompt must "
                              f"be 1, got {r.n_samples_per_prompt}")
        if t.loss_type == "policy_loss":
            raise ConfigError(f"{flag}: SFT rollouts have no rewards (reward 0, no advantage): train them with "
                              "--loss-type sft_loss (or custom_loss)")
        if d.data_source_path is None and d.prompt_data is None:
            raise ConfigError(f"{flag} --loss-type {t.loss_type}: SFT needs conversations: --prompt-data FILE "
                              "--input-key messages (a list of {role, content} per record)")
    if cfg.model.hf_checkpoint is None:
        raise ConfigError(f"{flag} builds rollouts on the rollout node with the tokenizer of --hf-checkpoint; "
                          "pass --hf-checkpoint")
    if r.eval_interval or d.eval_prompt_data or d.eval_config:
        raise ConfigError(f"{flag}: eval generates with the engines, and {flag} starts none; drop --eval-interval "
                          "and the eval data")
    if t.verify_weight_sync:
        raise ConfigError(f"--verify-weight-sync: {flag} starts no engines to compare the weights with")
    if r.custom_generate_function_path:
        raise ConfigError(f"--custom-generate-function-path generates with the engines, and {flag} starts none")


def min_distributed_timeout_s(weight_sync_timeout_s: float) -> float:
    """The smallest trainer process-group timeout that outlasts rank 0's longest lone phase."""
    return SINGLE_RANK_WEIGHT_SYNC_TIMEOUTS * weight_sync_timeout_s + 60.0


def _need(res: Resolved, strict: bool, msg: str) -> None:
    if strict:
        raise ConfigError(msg)
    res.warnings.append(msg)


def _check_run_dir(cfg: RunConfig) -> None:
    """A --run-dir that cannot be made or written here (a file on its path, a read-only place): one line
    before anything is submitted (the job writes it from every node; its filesystem is this one)."""
    from rlslurm.buffer.rundir import usable_refusal

    if (why := usable_refusal(cfg.run_dir)) is not None:
        raise ConfigError(f"--run-dir {cfg.run_dir}: {why}")


def _check_inputs(res: Resolved, strict: bool) -> None:
    from rlslurm.rollout.sft import SFT_ROLLOUT_FN

    cfg, mc = res.cfg, res.model
    d, m = cfg.data, cfg.model
    if d.data_source_path is None:
        if d.prompt_data is None:
            _need(res, strict, "--prompt-data is required (a .jsonl or .parquet file of prompts, or a directory "
                               "of them)")
        else:
            from rlslurm.rollout.prompt_records import validate_prompt_file

            # the file without slime's @[START:END] slice (rlslurm/settings/prompt_slice.py)
            if parse_prompt_spec(d.prompt_data).path.exists() or strict:
                sft = cfg.rollout.rollout_function_path == SFT_ROLLOUT_FN
                # SFT records are conversations: no label (rollout/sft.py)
                validate_prompt_file(d.prompt_data, d.input_key, None if sft else d.label_key)
                _check_prompt_supply(cfg, res.notes)
                if sft:
                    preflight.check_sft_data(cfg, res.warnings)
            else:
                res.warnings.append(f"--prompt-data {d.prompt_data} does not exist (here)")
    if d.eval_config is not None and not d.eval_config.is_file() and not strict:
        res.warnings.append(f"--eval-config {d.eval_config} does not exist (here)")
    else:
        flag = "--eval-config" if d.eval_config is not None else "--eval-prompt-data"
        from rlslurm.rollout.prompt_records import validate_prompt_file

        for ds in eval_datasets(cfg):
            if parse_prompt_spec(ds.path, flag).path.exists() or strict:
                validate_prompt_file(ds.path, ds.input_key, ds.label_key, flag=flag)
    if m.hf_checkpoint is None and m.load is None and not mc.tiny:
        _need(res, strict, f"--hf-checkpoint is required for {mc.name} (the HF directory with the initial weights)")
    for flag, p in (("--hf-checkpoint", m.hf_checkpoint), ("--ref-load", m.ref_load), ("--load", m.load)):
        if p is not None and not p.exists():
            _need(res, strict, f"{flag} {p} does not exist{model_download_hint(p, flag) if flag != '--load' else ''}")
        elif p is not None and flag != "--load":
            note = preflight.check_hf_dir(flag, p, mc, res.warnings)
            if note:
                res.notes.append(note)
    if cfg.slurm.setup_script is not None and not cfg.slurm.setup_script.is_file():
        _need(res, strict, f"--setup-script {cfg.slurm.setup_script} is not a file")
    replay = cfg.train.load_debug_rollout_data
    if replay is not None and not replay.is_dir():
        _need(res, strict, f"--load-debug-rollout-data {replay} is not a directory")
    elif replay is not None:
        preflight.check_replay_buffer(replay)
    check_subsample(cfg)
    missing_plugin = False
    for name in PLUGIN_FIELDS:
        spec = preflight.plugin_spec(cfg, name)
        if isinstance(spec, str) and ":" in spec and is_file_plugin(spec):
            f = Path(spec.rpartition(":")[0])
            if not f.is_file():
                missing_plugin = True
                _need(res, strict, f"{flag_name(name)} {spec}: {f} is not a file")
    if not missing_plugin:
        preflight.check_plugins(cfg, res.warnings)


def _check_prompt_supply(cfg: RunConfig, notes: list[str]) -> None:
    """--num-epoch given: refuse a run whose prompts run out before --num-rollout (every rollout takes
    at least --rollout-batch-size prompts; filters and over-sampling take more), as a driver that runs
    out ends the run early (control/data_exhausted.json). Not given: the prompts cycle, reshuffled per
    epoch with --rollout-shuffle, as slime's data source does; one note says how many epochs that is.
    A replay generates nothing."""
    from rlslurm.rollout.prompt_records import count_records

    d, r = cfg.data, cfg.rollout
    if cfg.train.load_debug_rollout_data is not None:
        return
    n = count_records(d.prompt_data)
    if n is None:
        return
    need = r.num_rollout * r.rollout_batch_size
    if d.num_epoch is None:
        epochs = -(-need // n)
        order = "reshuffled each epoch (--rollout-shuffle)" if d.rollout_shuffle else "in file order"
        notes.append(f"--num-rollout {r.num_rollout} x --rollout-batch-size {r.rollout_batch_size} = {need} prompts of "
                     f"--prompt-data's {n}: {epochs} epoch{'s' * (epochs != 1)} or more with filters, {order}; "
                     "--num-epoch N caps it")
        return
    if n * d.num_epoch >= need:
        return
    fewer = n * d.num_epoch // r.rollout_batch_size
    raise ConfigError(
        f"--prompt-data {d.prompt_data} has {n} prompts x --num-epoch {d.num_epoch}, but --num-rollout "
        f"{r.num_rollout} x --rollout-batch-size {r.rollout_batch_size} needs at least {need}: pass --num-epoch "
        f"{-(-need // n)}" + (f" or --num-rollout {fewer}" if fewer else ""))


def _check_memory(res: Resolved) -> None:
    cfg, mc = res.cfg, res.model
    if cfg.run.device != "cuda":
        return
    per_gpu = mc.num_params * _TRAIN_BYTES_PER_PARAM / cfg.trainer_gpus / 2**30
    if per_gpu > 80:
        res.warnings.append(
            f"{mc.name} ({mc.num_params / 1e9:.0f} B params) needs ~{per_gpu:.0f} GiB per trainer GPU for weights, "
            f"grads and Adam state on {cfg.trainer_gpus} GPUs: use more --trainer-nodes"
        )
