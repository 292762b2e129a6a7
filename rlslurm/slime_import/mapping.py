"""slime's train.py arguments -> rlslurm submit flags, with the reason for each one left out.

Order of the rules: architecture flags of MODEL_ARGS (rlslurm has them in --model's config), the
layout flags (trainer and engines on their own nodes here), slime's checkpoint and plugin flags
whose meaning differs, rlslurm's own fields and slime's aliases (rlslurm/settings/slime_flags.py), the
--sglang-* passthrough, the SLIME_INSTEAD hints, then megatron-core fields as --megatron-*.
Every flag that is passed on is checked alone by rlslurm's own parser first. The list for users:
docs/slime-flags.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlslurm.errors import ConfigError
from rlslurm.preflight import megatron_fields
from rlslurm.settings import low_precision
from rlslurm.settings.flags import FIELDS, build_config, parse_flags
from rlslurm.settings.placeholder import names as placeholder_names
from rlslurm.settings.slime_flags import SLIME_ALIASES, SLIME_ALWAYS, SLIME_INSTEAD
from rlslurm.slime_import.bash import Element

# slime's own plugins with an rlslurm built-in of the same rule.
PLUGIN_EQUIVALENTS = {
    "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std":
        "rlslurm.rollout.filters:zero_std_filter",
    # SFT: conversations -> assistant-turn loss masks, no engines (with --debug-train-only)
    "slime.rollout.sft_rollout.generate_rollout": "rlslurm.rollout.sft:generate_rollout",
}
# slime's default plugins: rlslurm does the same without the flag.
PLUGIN_DEFAULTS = {
    "slime.rollout.sglang_rollout.generate_rollout": "slime's default rollout; rlslurm's rollout driver does the "
                                                     "same without the flag",
    "slime.rollout.sglang_rollout.generate": "slime's default generate function; rlslurm's is the same "
                                             "single-turn call",
}
PLUGIN_FLAGS = ("custom_rm_path", "custom_generate_function_path", "rollout_function_path",
                "dynamic_sampling_filter_path", "buffer_filter_path", "data_source_path", "rollout_sample_filter_path",
                "custom_reward_post_process_path", "custom_loss_function_path", "custom_advantage_function_path",
                "custom_tis_function_path")

# where a plugin flag's rlslurm interface is described, for the port hint
PLUGIN_INTERFACES = {
    "rollout_function_path": " (async def f(ctx: RolloutContext), rlslurm/rollout/rollout_fn.py)",
    "custom_generate_function_path": " (async def f(ctx, prompt, sampling_params), rlslurm/rollout/generate_api.py)",
    "custom_rm_path": " (f(item: RewardInput) -> float, rlslurm/rollout/rewards.py)",
}
PORTING_GUIDE = "docs/slime-plugins.md"

# slime features the import cannot carry: a prefix of a plugin path or a flag name -> the feature.
# Each is "not mapped" on its line and named once more in a warning (Imported.warnings).
_OPD = "on-policy distillation"
FEATURE_PLUGINS = {
    "slime.rollout.on_policy_distillation.": _OPD,
    "slime.rollout.fully_async_rollout.": "fully-async rollout function",
}
_OPD_WHY = (f"{_OPD} (a teacher model's log-probs): rlslurm runs no teacher model and has no OPD loss "
            f"term; see {PORTING_GUIDE}")

_METRICS = "metrics go to RUN/metrics.jsonl and RUN/rollout_metrics.jsonl (TensorBoard when installed)"

_MTP = "MTP training"
_MTP_WHY = ("rlslurm builds and trains no MTP layers: the checkpoint's own are never loaded, trained or sent "
            "to the engines, whose MTP/EAGLE drafter keeps them as they are (docs/model-families.md)")
# Flags with nothing to pass on, and why (checked before the megatron-core fields).
NOT_MAPPED = {
    # slime trains MiMo's/GLM's MTP layers with these; megatron-core's mtp_* fields, passed through,
    # would ask for an MTP block rlslurm's model has no spec or mapping for
    "enable_mtp_training": _MTP_WHY,
    "mtp_num_layers": _MTP_WHY,
    "mtp_loss_scaling_factor": _MTP_WHY,
    "use_opd": _OPD_WHY,
    "accumulate_allreduce_grads_in_fp32": "a Megatron-LM DistributedDataParallelConfig setting; the "
                                          "--megatron-* passthrough sets TransformerConfig/OptimizerConfig "
                                          "fields only (rlslurm reduces gradients in fp32 already)",
    "attention_backend": "megatron-core's field is an AttnBackend enum the --megatron-* passthrough cannot "
                         "give; the core attention follows --transformer-impl (local: megatron-core's or "
                         "rlslurm's SDPA attention)",
    "use_tensorboard": _METRICS,
    "sglang_server_concurrency": "slime's own per-server request cap; rlslurm's is --rollout-max-concurrency "
                                 "(in flight over all engines), not set by the import",
    "sglang_router_ip": "rlslurm starts its own sglang-router on the rollout nodes",
    "sglang_router_port": "rlslurm starts its own sglang-router on the rollout nodes",
}
# slime flags of capabilities rlslurm has not: the flag's why, and the capability the run lacks (named
# once more in the import's warning)
FEATURE_FLAGS = {
    "multimodal_keys": ("slime feeds the records' images and videos (its JSON of media type -> record key) to a "
                        "vision-language model; rlslurm trains a VLM's language model on text only and sends no "
                        "media to the engines (docs/model-families.md, \"Qwen3.5\")", "VLM inputs (--multimodal-keys)"),
    "prefill_num_servers": ("slime runs this many SGLang prefill servers apart from the decode ones (PD "
                            "disaggregation); rlslurm's engines each prefill and decode",
                            "prefill/decode disaggregation (--prefill-num-servers)"),
    # slime's own flag (slime/backends/sglang_utils/arguments.py), not SGLang's --config behind the
    # --sglang-* prefix: its YAML's server_groups are engine groups of their own (sglang_config.py)
    "sglang_config": ("slime's YAML of engine groups (server_groups: prefill, decode, encoder or placeholder "
                      "engines, each with its GPUs and ServerArgs overrides), not SGLang's --config; rlslurm "
                      "runs one kind of engine with the --sglang-* flags of the command",
                      "engine groups of slime's --sglang-config (prefill/decode disaggregation, per-group "
                      "engine settings)"),
}
# --use-wandb and --wandb-* are rlslurm fields (docs/wandb.md) and pass as written; --wandb-key and
# slime's other W&B switches are SLIME_INSTEAD hints
_PREFIX_NOT_MAPPED = {"tb_": _METRICS, "opd_": _OPD_WHY}

_LAYOUT = ("actor_num_nodes", "actor_num_gpus_per_node", "rollout_num_gpus", "colocate")
_ARCH = "model architecture: rlslurm takes it from the --model config (rlslurm/settings/model_configs/)"


@dataclass
class Flag:
    name: str                      # as written, without the dashes
    values: list[str]
    line: int
    array: str | None
    unresolved: str | None = None  # why a value is not known

    @property
    def field(self) -> str:
        return self.name.replace("-", "_")

    @property
    def shown(self) -> str:
        return f"--{self.name}"


@dataclass
class Mapped:
    argv: list[str] = field(default_factory=list)
    dropped: list[tuple[int, str]] = field(default_factory=list)   # (line, "--flag: why")
    notes: list[tuple[int, str]] = field(default_factory=list)
    not_carried: list[tuple[int, str]] = field(default_factory=list)   # (line, feature) the run lacks
    # what became of each flag (by id): carried, renamed, set by rlslurm, not carried
    outcome: dict[int, str] = field(default_factory=dict)

    def count(self, what: str) -> int:
        return sum(1 for v in self.outcome.values() if v == what)


def group_flags(args: list[Element], dropped: list[tuple[int, str]]) -> list[Flag]:
    """`--flag v1 v2` / `--flag=v` / `--switch` out of the launch arguments, in order."""
    flags: list[Flag] = []
    for e in args:
        if e.text is not None and e.text.startswith("--"):
            name, eq, inline = e.text[2:].partition("=")
            flags.append(Flag(name, [inline] if eq else [], e.line, e.array))
        elif flags and flags[-1].array == e.array:
            if e.text is None:
                flags[-1].unresolved = flags[-1].unresolved or e.unresolved
            else:
                flags[-1].values.append(e.text)
        elif e.text is None and e.array == "MODEL_ARGS":
            continue  # the sourced model script's array: the --model config stands for it
        elif e.text is None:
            dropped.append((e.line, f"{e.unresolved} (cannot tell which flag this is)"))
        else:
            dropped.append((e.line, f"{e.text!r}: an argument that follows no flag"))
    return flags


def map_flags(flags: list[Flag], model: str | None, mla: bool, node_gpus: tuple[int, str] = (8, "")) -> Mapped:
    """`node_gpus`: the GPUs of a node the script is written for, and where that comes from."""
    m = _Mapper(flags, mla)
    for f in flags:
        m.one(f)
    out = m.out
    offload = m.by_field.get("optimizer_cpu_offload")
    if offload is not None and "use_distributed_optimizer" not in m.by_field and not offload.unresolved:
        # slime always runs megatron's distributed optimizer (slime/backends/megatron_utils/arguments.py
        # _set_default_megatron_args: "always use zero optimizer"); rlslurm only with DP > 1, and
        # megatron-core offloads only the distributed optimizer's state, so the offload needs it here
        out.argv.append("--use-distributed-optimizer")
        out.notes.append((offload.line, f"{offload.shown}: with --use-distributed-optimizer, which slime always "
                                        "sets and the offload needs (rlslurm's default is on only at DP > 1)"))
    _layout(m.layout, out, train_only="debug_train_only" in m.by_field, node_gpus=node_gpus)
    if model is not None:
        out.argv = ["--model", model] + out.argv
    return out


class _Mapper:
    """Each launch flag of the script to rlslurm's flags, or to a note saying why it is not carried."""

    def __init__(self, flags: list[Flag], mla: bool):
        self.out = Mapped()
        self.known_megatron = megatron_fields(mla)
        if self.known_megatron is None:
            self.out.notes.append((0, "megatron-core is not installed here: Megatron flags were passed as "
                                      "--megatron-* unchecked (the trainer checks them)"))
        self.by_field = {f.field: f for f in flags}
        self.layout: dict[str, Flag] = {}  # the layout flags, mapped together at the end (_layout)

    def drop(self, f: Flag, why: str) -> None:
        self.out.dropped.append((f.line, f"{f.shown}: {why}"))
        self.out.outcome[id(f)] = "not carried"

    def emit(self, f: Flag, argv: list[str]) -> None:
        if any(placeholder_names(a) for a in argv):
            self.out.argv += argv  # a value not known here: kept, visibly; submit refuses it until filled
            self.out.outcome[id(f)] = "carried"
            return
        try:  # alone through rlslurm's parser and field validation
            build_config([parse_flags(argv)])
        except ConfigError as e:
            self.drop(f, f"refused by rlslurm: {e}")
            return
        self.out.argv += argv
        self.out.outcome[id(f)] = "carried"

    def one(self, f: Flag) -> None:
        n = f.field
        if f.array == "MODEL_ARGS":
            self.drop(f, _ARCH)
        elif n in SLIME_ALWAYS:
            self.out.notes.append((f.line, f"{f.shown}: nothing to pass: {SLIME_ALWAYS[n]}"))
            self.out.outcome[id(f)] = "set by rlslurm"
        elif n == "ref_load":
            self.drop(f, "a Megatron torch_dist checkpoint in slime; rlslurm's --ref-load is a Hugging Face "
                         "directory and defaults to --hf-checkpoint")
        elif n in FEATURE_FLAGS:
            why, feature = FEATURE_FLAGS[n]
            self.drop(f, why)
            self.out.not_carried.append((f.line, feature))
        elif self._fixed(f):
            pass
        elif f.unresolved:
            self.drop(f, f"value not known without running the script: {f.unresolved}")
        elif n in _LAYOUT:
            self.layout[n] = f
            self.out.outcome[id(f)] = "carried"  # as the layout, or dropped there naming it
        elif n == "load":
            self._load(f)
        elif n in PLUGIN_FLAGS and f.values:
            self._plugin(f)
        elif n in FIELDS or n in SLIME_ALIASES:
            self.emit(f, [f.shown, *f.values])
        elif n.startswith("sglang_"):
            _sglang(f, self.out, self.emit, self.drop)
        else:
            self._megatron(f)

    def _fixed(self, f: Flag) -> bool:
        """A flag not carried whatever its value: dropped with the reason; False if `f` is not one."""
        n = f.field
        fixed = NOT_MAPPED.get(n) or next((r for p, r in _PREFIX_NOT_MAPPED.items() if n.startswith(p)), None)
        if n in SLIME_INSTEAD and n not in _LAYOUT:
            fixed = SLIME_INSTEAD[n]
        if not fixed:
            return False
        self.drop(f, fixed)
        if fixed is _OPD_WHY:
            self.out.not_carried.append((f.line, f"{_OPD} ({PORTING_GUIDE})"))
        elif fixed is _MTP_WHY and n == "enable_mtp_training":
            self.out.not_carried.append((f.line, f"{_MTP} (docs/model-families.md)"))
        elif n in low_precision.SLIME_FLAGS:
            self.out.not_carried.append((f.line, f"FP8/FP4 training: it trains in bf16 ({low_precision.DOC})"))
        return True

    def _load(self, f: Flag) -> None:
        save = self.by_field.get("save")
        if save is not None and not save.unresolved and save.values == f.values:
            self.drop(f, "the same directory as --save: slime's way to resume; rlslurm resumes from "
                         "RUN/checkpoints (rlslurm resubmit RUN)")
        else:
            self.drop(f, "a Megatron-LM checkpoint (iter_*/) in slime; rlslurm's --load takes an rlslurm "
                         "run's checkpoint or `rlslurm convert hf-to-mcore` output")

    def _plugin(self, f: Flag) -> None:
        n, spec = f.field, f.values[0]
        if spec in PLUGIN_EQUIVALENTS:
            self.emit(f, [f.shown, PLUGIN_EQUIVALENTS[spec]])
        elif spec in PLUGIN_DEFAULTS:
            self.drop(f, PLUGIN_DEFAULTS[spec])
        else:
            feature = next((v for k, v in FEATURE_PLUGINS.items() if spec.startswith(k)), None)
            what = f"{spec} is slime's {feature}" if feature else f"{spec} is a slime plugin"
            self.drop(f, f"{what} (slime calls it with its own arguments); port it to rlslurm's plugin "
                         f"interface{PLUGIN_INTERFACES.get(n, '')} and name it module.path:attr "
                         f"({PORTING_GUIDE})")
            self.out.not_carried.append((f.line, f"{feature or f.shown + ' ' + spec} ({PORTING_GUIDE})"))

    def _megatron(self, f: Flag) -> None:
        # Megatron-LM's flags whose TransformerConfig field is spelled otherwise
        # (--decoder-first/last-pipeline-num-layers) are rlslurm flags of slime's name (FIELDS)
        n = f.field
        if self.known_megatron is None or n in self.known_megatron:
            flag = "--megatron-" + n.replace("_", "-")
            self.emit(f, [flag, "[" + ", ".join(f.values) + "]"] if len(f.values) > 1 else [flag, *f.values])
            return
        self.drop(f, "not an rlslurm flag (rlslurm flags), a slime flag rlslurm maps, nor a megatron-core "
                     "TransformerConfig/OptimizerConfig field (--megatron-*)")


def _sglang(f: Flag, out: Mapped, emit, drop) -> None:
    from rlslurm.engines import sglang_flags, sglang_versions

    flag = "--" + f.name[len("sglang-"):]
    if flag in sglang_flags.OWNED_FLAGS:
        drop(f, f"rlslurm sets {flag} for every engine itself")
        return
    if sglang_flags.sglang_installed():
        if flag not in sglang_flags.sglang_server_flags():
            version = sglang_versions.installed_sglang_version()
            renamed = sglang_versions.renamed_flag(flag, version)
            if renamed is not None and renamed.new is not None:
                argv = renamed.argv(f.values)
                new = "--sglang-" + argv[0][2:]
                out.notes.append((f.line, f"{f.shown}: SGLang {version} calls it {new} "
                                          f"({' '.join([new, *argv[1:]])}: engines/sglang_versions.py)"))
                emit(f, [new, *argv[1:]])
                if out.outcome.get(id(f)) == "carried":
                    out.outcome[id(f)] = "renamed"
            elif renamed is not None and renamed.noop:
                drop(f, f"SGLang {version} dropped {flag}, which did nothing any more: {renamed.lost}")
            elif renamed is not None:
                drop(f, f"SGLang {version} dropped {flag} and has nothing in its place; the run does not have "
                        f"{renamed.lost}")
                out.not_carried.append((f.line, f"{f.shown}: {renamed.lost}"))
            else:
                drop(f, f"not a flag of SGLang {version} `launch_server` (slime's own, or another SGLang "
                        "version's)")
            return
    emit(f, [f.shown, *f.values])


def _int(f: Flag | None, out: Mapped) -> int | str | None:
    """The flag's whole number; its placeholder text when the value is not known here."""
    if f is None:
        return None
    if len(f.values) == 1 and f.values[0].isdigit():
        return int(f.values[0])
    if len(f.values) == 1 and placeholder_names(f.values[0]):
        return f.values[0]
    out.dropped.append((f.line, f"{f.shown}: expected one whole number, got {' '.join(f.values)!r}"))
    out.outcome[id(f)] = "not carried"
    return None


def _layout(layout: dict[str, Flag], out: Mapped, *, train_only: bool = False,
            node_gpus: tuple[int, str] = (8, "")) -> None:
    """slime's Ray placement -> rlslurm's: with slime's --colocate, ours (the engines on the trainer's
    own nodes and GPUs); a trainer of one node whose GPUs and the engines' fit one node, that node
    split between the two (docs/single-node.md), as Ray placed them on the script's one node;
    otherwise the two het groups, the trainer's nodes and then the engines' own."""
    trainer = _int(layout.get("actor_num_nodes"), out)
    gpus = _int(layout.get("actor_num_gpus_per_node"), out)
    argv: list[str] = []
    if "colocate" in layout:
        f = layout["colocate"]
        out.notes.append((f.line, f"{f.shown}: --colocate on the trainer's nodes and GPUs"))
        if "rollout_num_gpus" in layout:
            g = layout["rollout_num_gpus"]
            out.notes.append((g.line, f"{g.shown}: colocated, the engines use the trainer's GPUs"))
        argv.append("--colocate")
        if trainer is not None:
            argv += ["--nodes", str(trainer)]
        if gpus is not None:
            argv += ["--gpus-per-node", str(gpus)]
        out.argv = argv + out.argv
        return
    rollout_gpus = _int(layout.get("rollout_num_gpus"), out)
    known = all(v is None or isinstance(v, int) for v in (trainer, gpus, rollout_gpus))
    per_node, where = node_gpus
    if known and trainer == 1 and isinstance(gpus, int) and train_only and rollout_gpus is None:
        # slime's train-only run on one node; rlslurm's builds its (SFT) rollouts there too, without
        # engines, the trainer on every GPU (docs/slime-flags.md, --debug-train-only)
        f = layout["actor_num_nodes"]
        out.notes.append((f.line, f"{f.shown} 1 with --debug-train-only: --nodes 1, the trainer on its {gpus} GPUs "
                                  "and the rollouts built on the same node without engines"))
        out.argv = ["--nodes", "1", "--gpus-per-node", str(gpus)] + out.argv
        return
    if (known and trainer == 1 and isinstance(gpus, int) and isinstance(rollout_gpus, int)
            and gpus + rollout_gpus <= per_node):
        f = layout["rollout_num_gpus"]
        out.notes.append((f.line, f"--actor-num-nodes 1 x --actor-num-gpus-per-node {gpus} and {f.shown} "
                                  f"{rollout_gpus} fit one node of {per_node} GPUs ({where}): --nodes 1 "
                                  f"--gpus-per-node {gpus + rollout_gpus} --trainer-gpus {gpus} --rollout-gpus "
                                  f"{rollout_gpus} (docs/single-node.md)"))
        out.argv = ["--nodes", "1", "--gpus-per-node", str(gpus + rollout_gpus), "--trainer-gpus", str(gpus),
                    "--rollout-gpus", str(rollout_gpus)] + out.argv
        return
    rollout: int | str | None = None
    if rollout_gpus is not None:
        f = layout["rollout_num_gpus"]
        if isinstance(rollout_gpus, str) or isinstance(gpus, str):
            rollout = next(v for v in (rollout_gpus, gpus) if isinstance(v, str))
            out.notes.append((f.line, f"{f.shown} {rollout_gpus}: its nodes follow once "
                                      f"{' and '.join(placeholder_names(str(rollout)))} is known (import again with "
                                      "--var)"))
        elif gpus and rollout_gpus % gpus == 0:
            rollout = rollout_gpus // gpus
            out.notes.append((f.line, f"{f.shown} {rollout_gpus}: --rollout-nodes {rollout} of "
                                      f"--gpus-per-node {gpus}"))
        else:
            out.dropped.append((f.line, f"{f.shown} {rollout_gpus}: not a whole number of nodes of "
                                        f"--actor-num-gpus-per-node's GPUs; set --rollout-nodes"))
            out.outcome[id(f)] = "not carried"
    if trainer is not None and rollout is None and rollout_gpus is None and train_only:
        # slime's train-only run has no rollout GPUs; rlslurm's builds its (SFT) rollouts on a node of
        # the rollout group without engines (docs/slime-flags.md, --debug-train-only)
        rollout = 1
        f = layout["actor_num_nodes"]
        out.notes.append((f.line, f"{f.shown} {trainer} with --debug-train-only and no --rollout-num-gpus: "
                                  "--rollout-nodes 1, the node that builds the rollouts without engines"))
    if isinstance(trainer, int) and isinstance(rollout, int):
        argv += ["--nodes", str(trainer + rollout)]
    elif trainer is not None and rollout is not None:
        argv += ["--nodes", next(v for v in (trainer, rollout) if isinstance(v, str))]
    if trainer is not None:
        argv += ["--trainer-nodes", str(trainer)]
    if rollout is not None:
        argv += ["--rollout-nodes", str(rollout)]
    if gpus is not None:
        argv += ["--gpus-per-node", str(gpus)]
    out.argv = argv + out.argv
