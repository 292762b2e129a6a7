"""The one typed config of a run.

Sources, lowest priority first: the model config's defaults for the node count
(`model_configs/<model>.yaml`), a user YAML file (`--config run.yaml`), then CLI flags.
Every leaf field is a flag: `--<field-name>` (field names are unique across sections and
follow slime/Megatron naming, so `--rollout-batch-size` is `rollout.rollout_batch_size`).
Two passthrough families: `--sglang-<flag>` (to every SGLang server) and `--megatron-<field>`
(a megatron-core TransformerConfig/OptimizerConfig field). The resolved config is written to
`RUN/run.yaml` at submit and is immutable afterwards; both het groups read it from there.
"""

from __future__ import annotations

import re
import string
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from rlslurm.secret_env import looks_secret
from rlslurm.settings.prompt_slice import parse_prompt_spec
from rlslurm.settings.rl_settings import ESTIMATOR_NAMES, LOSS_TYPE_NAMES
from rlslurm.settings.rm_types import RM_REFUSED, RM_TYPES
from rlslurm.settings.timespec import time_limit_s
from rlslurm.settings.transformer_impl import TransformerImpl

# SLURM names (partition, account, qos, ...): what sbatch accepts without quoting. Patterns are
# used with fullmatch: `$` also matches before a trailing newline, which would end the #SBATCH line.
_SLURM_NAME = re.compile(r"[A-Za-z0-9_.,:@+=-]+")


def check_slurm_name(v: str) -> str:
    """A partition/account/qos value as sbatch takes it unquoted (also `rlslurm convert --submit`'s);
    ValueError otherwise."""
    if not _SLURM_NAME.fullmatch(v):
        raise ValueError(f"{v!r} is not a valid SLURM name (letters, digits and _.,:@+=- only)")
    return v


class Section(BaseModel):
    # NaN slips through every ge/gt bound (all comparisons are false) and inf is never a useful setting
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


# Every field carries a `description`: `rlslurm flags` prints it, and it is the one place a field's
# meaning is written down (tests/launcher/test_flag_help.py checks that none is missing). Comments
# beside a field say why it is built that way; the description says what it does for the user.


# `--run-name`'s default; the run directory's rule is `run_dir_of`.
DEFAULT_RUN_NAME = "rlslurm"


def run_dir_of(run_dir: Path | None, run_name: str | None = None) -> Path:
    """The one rule for a run's directory: --run-dir, else ./runs/<run-name> (run name default:
    DEFAULT_RUN_NAME), relative to where the command runs until resolve() makes it absolute."""
    return run_dir or Path("runs") / (run_name or DEFAULT_RUN_NAME)


class RunSection(Section):
    run_name: str = Field(DEFAULT_RUN_NAME,
                          description="name of the run: the SLURM job name and the default run directory "
                                                 "runs/<run-name>")
    run_dir: Path | None = Field(None, description="run directory on shared storage, seen by every node "
                                                   "(default: ./runs/<run-name>)")
    seed: int = Field(1234, description="random seed of the trainer (initialisation, dropout)")
    device: Literal["cuda", "cpu"] = Field("cuda", description="cuda on GPU nodes; cpu runs megatron-core over gloo "
                                                              "and SGLang's CPU mode (tests, the demo)")
    # rlslurm/stacks.py: each role checks its torch, megatron-core, SGLang and transformer-engine at its start
    allow_untested_stack: bool = Field(False, description="go on, with a warning, when the installed torch, "
                                                          "megatron-core, SGLang or transformer-engine are not one "
                                                          "supported stack (docs/supported-stacks.md)")
    group_shared: bool = Field(False, description="make the run directory 2750 (group-readable, setgid) instead "
                                                  "of 0700 (docs/security.md)")
    # weight sync then goes over gloo: NCCL refuses two ranks on one GPU (docs/gpu.md)
    shared_gpu: bool = Field(False, description="`rlslurm run` only: the trainer and the engines share this "
                                                "machine's GPU(s) as separate processes (a one-GPU box; the "
                                                "engines size their share beside the trainer, docs/gpu.md)")
    colocate: bool = Field(False, description="slime's --colocate: trainer and engines on the same GPUs of every "
                                              "node, taking turns (docs/colocate.md)")
    offload_train: bool | None = Field(
        None, description="--colocate only: move the trainer's whole state to host memory while the engines "
                          "generate (slime's default); --no-offload-train keeps it all on the GPUs beside the "
                          "engines. Default: the trainer keeps what fits beside the engines' weights and a KV "
                          "cache for a whole rollout, and moves the rest (docs/colocate.md)")
    # Read by rlslurm/metrics_sink.py only; the API key is never a field: WANDB_API_KEY goes
    # through --secret-env (docs/security.md).
    use_wandb: bool = Field(False, description="log metrics to Weights & Biases, one run per role in one group "
                                               "(docs/wandb.md)")
    wandb_mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="W&B mode (default: WANDB_MODE from --env, else online)")
    wandb_project: str | None = Field(None, description="W&B project")
    wandb_group: str | None = Field(None, description="W&B group of the two runs (default: --run-name)")
    wandb_team: str | None = Field(None, description="W&B entity (team or user)")
    wandb_host: str | None = Field(None, description="W&B server URL of a self-hosted instance, e.g. "
                                                     "https://wandb.example.org")
    wandb_dir: Path | None = Field(None, description="W&B's local directory (default: RUN/wandb)")
    # resolve derives it from the run name and directory, and run.yaml keeps it, so every attempt
    # resumes the same runs.
    wandb_run_id: str | None = Field(None, description="base of the two W&B run ids (<id>-trainer, <id>-rollout); "
                                                       "default: derived from the run")

    @field_validator("wandb_run_id")
    @classmethod
    def _wandb_run_id(cls, v: str | None) -> str | None:
        # wandb 0.31 refuses :;,#?/' in an id; a plain charset and a length that leaves room for
        # the role suffix keep it a valid id (and a file name) everywhere
        if v is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,54}", v):
            raise ValueError("a W&B run id here is 1-55 letters, digits, '_', '.', '-' (the roles add -trainer "
                             "and -rollout)")
        return v

    @field_validator("wandb_host")
    @classmethod
    def _wandb_host(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"https?://[^\s/]+(/\S*)?", v):
            raise ValueError("not an http(s):// URL of a W&B server")
        return v


class SlurmSection(Section):
    nodes: int = Field(2, ge=1, description="total nodes of the job: trainer + rollout (1: both groups on one node, "
                                            "docs/single-node.md)")
    trainer_nodes: int | None = Field(None, ge=1, description="nodes of het group 0, the trainer (default: from the "
                                                              "model config's layout for --nodes)")
    rollout_nodes: int | None = Field(None, ge=1, description="nodes of het group 1, the engines and the rollout "
                                                              "driver (default: the rest of --nodes)")
    gpus_per_node: int = Field(8, ge=0, description="GPUs of each node (sbatch --gpus-per-node); 0 on CPU-only "
                                                    "nodes")
    # slime's --actor-num-gpus-per-node and --rollout-num-gpus
    trainer_gpus: int | None = Field(None, ge=1, description="--nodes 1 only: the node's GPUs the trainer takes "
                                                             "(default: half, or the rest of --rollout-gpus)")
    rollout_gpus: int | None = Field(None, ge=0, description="--nodes 1 only: the node's GPUs the engines take "
                                                             "(default: half, or the rest of --trainer-gpus)")
    trainer_procs_per_node: int | None = Field(None, ge=1, description="trainer processes per node (default: "
                                                                       "--gpus-per-node; on CPU set it)")
    cpus_per_node: int | None = Field(None, ge=1, description="sbatch --cpus-per-task of each node's one task")
    mem: str | None = Field(None, description="sbatch --mem per node, e.g. 500G")
    partition: str | None = Field(None, description="SLURM partition of both groups")
    trainer_partition: str | None = Field(None, description="partition of the trainer group (overrides "
                                                            "--partition)")
    rollout_partition: str | None = Field(None, description="partition of the rollout group (overrides "
                                                            "--partition)")
    account: str | None = Field(None, description="SLURM account to charge")
    qos: str | None = Field(None, description="SLURM quality of service")
    time: str = Field("24:00:00", description="time limit of each attempt (sbatch --time: MIN, HH:MM:SS, "
                                              "D-HH:MM:SS); at least twice --signal-grace-s")
    exclusive: bool = Field(True, description="sbatch --exclusive: whole nodes (--no-exclusive shares them)")
    container_image: str | None = Field(None, description="pyxis/enroot image every step runs in (srun "
                                                          "--container-image), e.g. nvcr.io#nvidia/pytorch:25.01-py3")
    container_mounts: str | None = Field(None, description="pyxis --container-mounts with --container-image, "
                                                           "e.g. /gpfs:/gpfs (the run directory must be inside)")
    apptainer_image: str | None = Field(None, description="run every step as `apptainer exec --nv IMAGE ...` "
                                                          "(a .sif path)")
    signal_grace_s: int = Field(300, ge=30, description="seconds before the time limit SLURM sends USR1: the "
                                                        "trainer checkpoints and the job requeues itself")
    max_failures: int = Field(3, ge=0, description="failed attempts in a row without a new checkpoint that are "
                                                   "requeued before the job gives up (preemptions do not count)")
    python: str | None = Field(None, description="Python interpreter on the nodes (default: the one running "
                                                 "`rlslurm submit`; it must exist on every node)")
    setup_script: Path | None = Field(None, description="bash file every step sources before Python (module "
                                                        "load, conda/venv activate)")
    env: dict[str, str] = Field(default_factory=dict, description="environment of every step: NAME=VALUE ... "
                                                                  "(repeatable; adds to a config file's env:; "
                                                                  "secret-looking names move to --secret-env)")
    # Names passed by file, not by run.yaml (rlslurm/secret_env.py): secret-looking --env names
    # are moved here at validation.
    secret_env: list[str] = Field(default_factory=list, description="variables passed through a 0600 file, never "
                                                                    "run.yaml; a name alone takes its value from "
                                                                    "the submitting environment")
    # In every het component: SLURM applies an option given before the first `hetjob` line to
    # component 0 only (a --constraint there never reached the rollout group; measured on SLURM 22.05,
    # docs/slurm-test-cluster.md); repeating one per component is accepted.
    sbatch_extra: list[str] = Field(default_factory=list, description="extra sbatch options, --key=value, given to "
                                                                      "every het group (e.g. --constraint=h100)")
    # after --sbatch-extra in the component: sbatch takes the last of two same options (measured)
    trainer_sbatch_extra: list[str] = Field(default_factory=list, description="extra sbatch options of the "
                                                                              "trainer group only (the same option "
                                                                              "as in --sbatch-extra wins)")
    rollout_sbatch_extra: list[str] = Field(default_factory=list, description="extra sbatch options of the "
                                                                              "rollout group only (the same option "
                                                                              "as in --sbatch-extra wins)")

    @field_validator("partition", "trainer_partition", "rollout_partition", "account", "qos", "mem")
    @classmethod
    def _slurm_name(cls, v: str | None) -> str | None:
        return None if v is None else check_slurm_name(v)

    @field_validator("time")
    @classmethod
    def _time(cls, v: str) -> str:
        time_limit_s(v)  # raises on anything sbatch would not take
        return v

    @field_validator("env", "secret_env")
    @classmethod
    def _env(cls, v: dict[str, str] | list[str]) -> dict[str, str] | list[str]:
        for k in v:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
                raise ValueError(f"{k!r} is not a valid environment variable name")
        return v

    # Values of the secrets given as --env NAME=VALUE: a private attribute, so model_dump (run.yaml,
    # the rendered script) never carries them; submit writes them to RUN/control/secret_env (0600).
    _secret_given: dict[str, str] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _secrets_out_of_env(self) -> "SlurmSection":
        moved = {k: v for k, v in self.env.items() if k in self.secret_env or looks_secret(k)}
        if moved:
            self._secret_given.update(moved)
            # through __dict__: an assignment would re-run this validator (validate_assignment)
            self.__dict__["env"] = {k: v for k, v in self.env.items() if k not in moved}
            self.__dict__["secret_env"] = list(dict.fromkeys([*self.secret_env, *moved]))
        return self

    def secret_given(self) -> dict[str, str]:
        """The secret values given as `--env NAME=VALUE` in this process (never from run.yaml)."""
        return dict(self._secret_given)

    @field_validator("sbatch_extra", "trainer_sbatch_extra", "rollout_sbatch_extra")
    @classmethod
    def _extra(cls, v: list[str]) -> list[str]:
        for opt in v:
            if not re.fullmatch(r"--[a-z][a-z0-9-]*(=[A-Za-z0-9_.,:@+=/%-]*)?", opt):
                raise ValueError(f"{opt!r}: extra sbatch options must look like --key=value with a plain value")
        return v


class ModelSection(Section):
    model: str | None = Field(None, description="model config: a name from `rlslurm models` or a YAML path "
                                                "(default: built from --hf-checkpoint's config.json)")
    hf_checkpoint: Path | None = Field(None, description="HF model directory: initial actor and reference "
                                                         "weights, and the tokenizer")
    ref_load: Path | None = Field(None, description="reference model for the KL terms (default: "
                                                    "--hf-checkpoint)")
    load: Path | None = Field(None, description="Megatron distributed checkpoint to start from (default: "
                                                "RUN/checkpoints)")


class DataSection(Section):
    prompt_data: Path | None = Field(None, description="training prompts: a .jsonl or .parquet file, a directory "
                                                       "of such shards, or a `datasets` save_to_disk directory; "
                                                       "PATH@[START:END] takes a slice")
    input_key: str = Field("prompt", description="record key of the prompt (text, or a list of chat messages)")
    label_key: str | None = Field("label", description="record key of the label the reward compares with")
    metadata_key: str | None = Field(None, description="record key of a JSON object passed to the reward and "
                                                       "generate functions")
    tool_key: str | None = Field(None, description="record key of the tool list given to the chat template")
    apply_chat_template: bool = Field(False, description="format each prompt with the tokenizer's chat template")
    apply_chat_template_kwargs: dict[str, Any] = Field(default_factory=dict, description="extra arguments of the "
                                                                                         "chat template, KEY=VALUE "
                                                                                         "or JSON")
    rollout_shuffle: bool = Field(True, description="shuffle the prompts each epoch")
    rollout_seed: int = Field(42, description="seed of the prompt shuffle")
    num_epoch: int | None = Field(None, ge=1, description="passes over the prompts the run may take (default: as "
                                                          "many as --num-rollout needs, slime's)")
    max_prompt_len: int | None = Field(None, ge=1, description="drop prompts longer than this many tokens")
    data_strict: bool = Field(True, description="a malformed prompt record is an error naming file:line "
                                                "(--no-data-strict counts and skips it)")
    data_source_path: str | None = Field(None, description="module:Class of a custom prompt source, instead of "
                                                           "--prompt-data")
    eval_prompt_data: list[str] = Field(default_factory=list, description="evaluation sets: NAME PATH [NAME PATH "
                                                                          "...]")
    eval_config: Path | None = Field(None, description="slime's per-dataset eval YAML, instead of "
                                                       "--eval-prompt-data (rlslurm/settings/eval_config.py)")

    @field_validator("eval_prompt_data")
    @classmethod
    def _pairs(cls, v: list[str]) -> list[str]:
        if len(v) % 2:
            raise ValueError("expects NAME PATH pairs")
        for path in v[1::2]:
            parse_prompt_spec(path, "--eval-prompt-data")
        return v

    @field_validator("prompt_data")
    @classmethod
    def _slice(cls, v: Path | None) -> Path | None:
        if v is not None:
            parse_prompt_spec(v)  # slime's PATH@[START:END]: a malformed slice is refused here, at submit
        return v


class RolloutSection(Section):
    num_rollout: int = Field(100, ge=0, description="rollouts to generate and train; the run is FINISHED after the "
                                                    "last")
    rollout_batch_size: int = Field(32, ge=1, description="prompts per rollout")
    n_samples_per_prompt: int = Field(8, ge=1, description="samples generated per prompt (a GRPO group)")
    over_sampling_batch_size: int | None = Field(None, ge=1, description="prompts drawn at a time while dynamic "
                                                                         "sampling fills a rollout (default: "
                                                                         "--rollout-batch-size)")
    # abort = batch full, weight update or preempt
    partial_rollout: bool = Field(False, description="slime's --partial-rollout: groups cut off by an abort go back "
                                                     "with their tokens so far and are continued, not restarted")
    mask_offpolicy_in_partial_rollout: bool = Field(False, description="with --partial-rollout: tokens generated by "
                                                                       "weights older than a sample's newest segment "
                                                                       "get loss mask 0")
    rollout_max_response_len: int = Field(1024, ge=1, description="most tokens generated per sample")
    rollout_max_context_len: int | None = Field(None, ge=2, description="prompt + response tokens at most (slime's "
                                                                        "name); longer prompts are dropped")
    # slime's default is False; rlslurm's reward text has always skipped them
    rollout_skip_special_tokens: bool = Field(True, description="the reward sees the response without special tokens "
                                                                "(--no-rollout-skip-special-tokens keeps them)")
    rollout_temperature: float = Field(1.0, ge=0, description="sampling temperature of the rollouts")
    rollout_top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: top-p of the rollouts")
    rollout_top_k: int = Field(-1, description="top-k of the rollouts: -1 (the whole vocabulary) or >= 1")
    rollout_stop: list[str] = Field(default_factory=list, description="stop strings of the rollouts")
    rollout_stop_token_ids: list[int] = Field(default_factory=list, description="stop token ids of the rollouts")
    rollout_num_gpus_per_engine: int = Field(1, ge=1, description="GPUs per SGLang engine (its tensor-parallel "
                                                                  "size); may span nodes")
    engines_per_node: int | None = Field(None, ge=1, description="SGLang servers per rollout node (default: GPUs "
                                                                 "/ --rollout-num-gpus-per-engine; CPU: set it)")
    # An engine spanning nodes with --sglang-enable-dp-attention talks between its nodes over SGLang
    # ZMQ ports that take pickled objects from anyone who connects (docs/security.md, "Engines spanning
    # nodes"): refused unless the user names the interface they bind (a network only the job's nodes
    # reach) or states that they are closed otherwise (a firewall, a private job network).
    engine_span_interface: str | None = Field(None, description="engines spanning nodes with DP attention: the "
                                                                "network interface their ZMQ ports bind to (one "
                                                                "only the job's nodes reach)")
    engine_span_ports_closed: bool = Field(False, description="engines spanning nodes with DP attention: their "
                                                              "ZMQ ports are closed to others by other means "
                                                              "(firewall, private job network)")
    rollout_dtype: str | None = Field(None, description="the engines' --dtype, e.g. float32 for exact CPU tests")
    # engines/sglang_versions.py: an untested version gets the API of the nearest tested one below it
    allow_untested_sglang: bool = Field(False, description="rollout nodes: start the engines with an SGLang (or the "
                                                           "torch under it) of no supported stack, with a warning "
                                                           "instead of an error (docs/sglang-versions.md)")
    rm_type: Literal[RM_TYPES] = Field(  # type: ignore[valid-type]  # rlslurm/settings/rm_types.py
        "math", description="built-in reward: math, exact, dapo, f1, gpqa, remote, ... (docs/slime-flags.md); "
                            "--custom-rm-path wins")
    rm_url: str | None = Field(None, description="URL of an HTTP reward model (--rm-type remote)")
    custom_rm_path: str | None = Field(None, description="your reward function, module:fn or file.py:fn "
                                                         "(per sample, or per group with @group_reward)")
    custom_generate_function_path: str | None = Field(None, description="async function turning one prompt into "
                                                                        "its samples (multi-turn, tools; "
                                                                        "rollout/generate_api.py)")
    rollout_function_path: str | None = Field(None, description="slime's flag: async function generating a whole "
                                                                "rollout instead of the driver's group loop "
                                                                "(rollout/rollout_fn.py)")
    dynamic_sampling_filter_path: str | None = Field(None, description="function keeping or dropping each finished "
                                                                       "group (dynamic sampling, "
                                                                       "rollout/filters.py)")
    rollout_sample_filter_path: str | None = Field(None, description="function marking samples not to train on "
                                                                     "(rollout/filters.py)")
    buffer_filter_path: str | None = Field(None, description="function choosing which handed-back prompts are "
                                                             "served again first (default: oldest first)")
    reward_key: str | None = Field(None, description="the key to train on when the reward returns a dict of "
                                                     "scores")
    rollout_max_concurrency: int = Field(256, ge=1, description="generate requests in flight at once from the "
                                                                "rollout driver")
    async_buffer_size: int = Field(0, ge=0, description="rollouts generation may run ahead of training (0: "
                                                        "synchronous: generate, train, sync)")
    update_weights_interval: int = Field(1, ge=1, description="trained rollouts between weight syncs to the "
                                                              "engines")
    engine_health_interval_s: float = Field(10.0, gt=0, description="seconds between health checks of each "
                                                                    "engine (a dead one is restarted)")
    eval_interval: int | None = Field(None, ge=1, description="evaluate every N rollouts (needs "
                                                              "--eval-prompt-data or --eval-config)")
    skip_eval_before_train: bool = Field(False, description="no eval at rollout 0 (the weights before training)")
    n_samples_per_eval_prompt: int = Field(1, ge=1, description="samples per eval prompt")
    eval_temperature: float | None = Field(None, ge=0, description="sampling temperature of eval (default: "
                                                                   "--rollout-temperature, slime's)")
    eval_max_response_len: int | None = Field(None, ge=1, description="most tokens generated per eval sample "
                                                                      "(default: --rollout-max-response-len)")
    eval_top_p: float | None = Field(None, gt=0, le=1, description="top-p of eval (default: --rollout-top-p)")
    eval_top_k: int | None = Field(None, description="top-k of eval (default: --rollout-top-k)")
    # rollouts a kept checkpoint (--keep-checkpoints) would train again after a fallback stay as
    # well (docs/buffer-retention.md)
    keep_trained_rollouts: int = Field(4, ge=0, description="trained rollouts kept in the buffer after a "
                                                            "checkpoint, at least (docs/buffer-retention.md)")
    # rlslurm/buffer/export.py
    export_retired_rollouts: Path | None = Field(None, description="directory where each rollout retired from "
                                                                   "the buffer is first written as JSONL (default: "
                                                                   "deleted)")

    @field_validator("rm_type", mode="before")
    @classmethod
    def _rm_type(cls, v: Any) -> Any:
        if isinstance(v, str) and v in RM_REFUSED:
            raise ValueError(f"{v!r} is {RM_REFUSED[v]}")
        return v

    @field_validator("rollout_top_k", "eval_top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        if v is not None and v != -1 and v < 1:
            raise ValueError("must be -1 (no top-k cut) or >= 1 (SGLang refuses other values per request)")
        return v

    @field_validator("mask_offpolicy_in_partial_rollout")
    @classmethod
    def _mask_needs_partial(cls, v: bool, info: ValidationInfo) -> bool:
        if v and not info.data.get("partial_rollout", False):
            raise ValueError("needs --partial-rollout (without it no sample carries older tokens)")
        return v


def _check_pattern(v: str | None, allowed: tuple[str, ...]) -> str | None:
    """A path pattern the trainer fills with str.format: only the `allowed` fields."""
    if v is None:
        return v
    names = " and ".join("{" + a + "}" for a in allowed)
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(v) if f is not None}
    except ValueError as e:
        raise ValueError(f"not a pattern ({e}); it takes {names}") from None
    if fields - set(allowed):
        raise ValueError(f"the fields it takes are {names}, not {{{sorted(fields - set(allowed))[0]}}}")
    return v


class TrainSection(Section):
    # Megatron names, so users can paste slime/Megatron flags.
    tensor_model_parallel_size: int = Field(1, ge=1, description="trainer tensor parallelism (TP)")
    pipeline_model_parallel_size: int = Field(1, ge=1, description="trainer pipeline parallelism (PP)")
    # slime's (Megatron-LM's) flags; megatron-core's TransformerConfig num_layers_in_first/last_pipeline_stage.
    # The split rule and its refusals: rlslurm/settings/parallel_grid.py stage_layers
    decoder_first_pipeline_num_layers: int | None = Field(None, ge=1, description="transformer layers of the "
                                                                                  "first pipeline stage (default: "
                                                                                  "an even split; the stages "
                                                                                  "between share the rest evenly)")
    decoder_last_pipeline_num_layers: int | None = Field(None, ge=1, description="transformer layers of the last "
                                                                                 "pipeline stage (default: an "
                                                                                 "even split; the stages between "
                                                                                 "share the rest evenly)")
    context_parallel_size: int = Field(1, ge=1, description="trainer context parallelism (CP): every sequence cut "
                                                            "over CP ranks, rlslurm's own attention "
                                                            "(docs/context-parallel.md)")
    expert_model_parallel_size: int = Field(1, ge=1, description="trainer expert parallelism of MoE layers (EP)")
    # slime's flag; megatron-core's own default is TP too (rlslurm/settings/parallel_grid.py)
    expert_tensor_parallel_size: int | None = Field(None, ge=1, description="trainer tensor parallelism of the "
                                                                            "routed experts (ETP; default: "
                                                                            "--tensor-model-parallel-size)")
    micro_batch_size: int = Field(1, ge=1, description="samples per micro-batch of each data-parallel rank")
    global_batch_size: int | None = Field(None, ge=1, description="samples per optimizer step (default: from "
                                                                  "rollout-batch-size x n-samples-per-prompt / "
                                                                  "num-steps-per-rollout)")
    num_steps_per_rollout: int = Field(1, ge=1, description="optimizer steps per rollout")
    use_dynamic_batch_size: bool = Field(False, description="pack micro-batches up to --max-tokens-per-gpu tokens "
                                                            "instead of --micro-batch-size samples")
    max_tokens_per_gpu: int | None = Field(None, ge=1, description="tokens per micro-batch with "
                                                                   "--use-dynamic-batch-size")
    # slime's default is thd; ours stays bshd until the packed path is measured on GPU
    # (trainer/batching.py, docs/sequence-packing.md)
    qkv_format: Literal["bshd", "thd"] = Field("bshd", description="thd packs each micro-batch's samples into one "
                                                                   "row (no padding); bshd right-pads them")
    # slime's (Megatron-LM's) flag and megatron-core's TransformerConfig field; never chosen because
    # transformer-engine imports (rlslurm/settings/transformer_impl.py, docs/transformer-engine.md)
    transformer_impl: TransformerImpl = Field(
        "local", description="the trainer's layer implementation: local (megatron-core's own modules, the one "
                             "rlslurm has run on CPU and GPU) or transformer_engine (never run by rlslurm's tests; "
                             "needs transformer-engine in megatron-core's supported range)")
    lr: float = Field(1e-6, gt=0, description="learning rate of the actor")
    min_lr: float = Field(0.0, ge=0, description="lowest learning rate of a decaying schedule")
    lr_decay_style: Literal["constant", "linear", "cosine"] = Field("constant", description="learning-rate "
                                                                                            "schedule")
    lr_warmup_iters: int = Field(0, ge=0, description="optimizer steps of linear learning-rate warm-up")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="Adam beta1")
    adam_beta2: float = Field(0.98, ge=0, lt=1, description="Adam beta2")
    adam_eps: float = Field(1e-8, gt=0, description="Adam epsilon")
    clip_grad: float = Field(1.0, ge=0, description="gradient norm clipping (0: off)")
    bf16: bool = Field(True, description="train in bfloat16 (--no-bf16: fp32)")
    use_distributed_optimizer: bool | None = Field(None, description="shard the Adam state over data-parallel "
                                                                     "ranks (default: on when DP > 1)")
    # bounds the work a hard kill (node failure, SIGKILL past KillWait) loses; preempt, stop,
    # SIGTERM and the end of the run save on their own
    save_interval: int | None = Field(10, ge=1, description="rollouts between checkpoints (null: only at "
                                                            "preemption, stop and the end)")
    keep_checkpoints: int = Field(2, ge=1, description="checkpoints kept in RUN/checkpoints")
    # forked writers write it while the trainer trains on, and `latest` moves once it is complete and
    # verified (trainer/checkpoint/writer.py, docs/checkpoints.md)
    async_save: bool = Field(True, description="megatron's --async-save: a save stalls training only while the "
                                               "state is copied off the model (--no-async-save: the trainer "
                                               "waits for the write)")
    save_hf: str | None = Field(None, description="slime's --save-hf: with every checkpoint, the weights in HF "
                                                  "format to this directory ({rollout_id} filled in)")
    save_debug_train_data: str | None = Field(None, description="per rollout and rank, what the loss is computed "
                                                                "from as a torch file to this path ({rollout_id}, "
                                                                "{rank})")

    @property
    def expert_tp(self) -> int:
        """ETP as the trainer runs it: --expert-tensor-parallel-size, else TP (megatron-core's default)."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @field_validator("save_hf")
    @classmethod
    def _save_hf(cls, v: str | None) -> str | None:
        return _check_pattern(v, ("rollout_id",))

    @field_validator("save_debug_train_data")
    @classmethod
    def _save_debug_train_data(cls, v: str | None) -> str | None:
        return _check_pattern(v, ("rollout_id", "rank"))

    # RL
    loss_type: Literal[LOSS_TYPE_NAMES] = Field(  # type: ignore[valid-type]  # rlslurm/settings/rl_settings.py
        "policy_loss", description="policy_loss, sft_loss or custom_loss (rlslurm/settings/rl_settings.py)")
    custom_loss_function_path: str | None = Field(None, description="your loss function with --loss-type "
                                                                    "custom_loss (trainer/actor_loss.py)")
    advantage_estimator: Literal[ESTIMATOR_NAMES] = Field(  # type: ignore[valid-type]  # rlslurm/settings/rl_settings.py
        "grpo", description="grpo, gspo, cispo, reinforce_plus_plus, reinforce_plus_plus_baseline or ppo "
                            "(rlslurm/settings/rl_settings.py)")
    custom_advantage_function_path: str | None = Field(None, description="function replacing the estimator's "
                                                                         "advantages (trainer/advantages.py)")
    custom_reward_post_process_path: str | None = Field(None, description="function replacing the group baseline "
                                                                          "(trainer/advantages.py)")
    grpo_std_normalization: bool = Field(True, description="divide GRPO advantages by the group's reward std "
                                                           "(--no-grpo-std-normalization: Dr.GRPO)")
    rewards_normalization: bool = Field(True, description="subtract the group baseline at all (slime: "
                                                          "--disable-rewards-normalization)")
    normalize_advantages: bool = Field(False, description="whiten the advantages over the batch")
    eps_clip: float = Field(0.2, gt=0, le=1, description="PPO ratio clip (lower bound, and upper without "
                                                   "--eps-clip-high)")
    eps_clip_high: float | None = Field(None, gt=0, description="upper PPO ratio clip (DAPO's clip-higher)")
    eps_clip_c: float | None = Field(None, gt=1, description="dual-clip bound for negative advantages (> 1)")
    use_kl_loss: bool = Field(False, description="add a KL(actor || reference) loss term")
    kl_loss_coef: float = Field(0.0, ge=0, description="weight of the KL loss term")
    # trainer/losses.kl_estimate
    use_unbiased_kl: bool = Field(False, description="weight the KL loss by the new/old probability ratio")
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = Field("low_var_kl", description="KL estimator of the "
                                                                                           "KL loss")
    kl_coef: float = Field(0.0, ge=0, description="KL penalty folded into the per-token reward")
    entropy_coef: float = Field(0.0, ge=0, description="weight of the entropy bonus")
    calculate_per_token_loss: bool = Field(False, description="average the loss over tokens of the batch instead "
                                                              "of per sample")
    gamma: float = Field(1.0, ge=0, le=1, description="discount factor (PPO/GAE)")
    lambd: float = Field(1.0, ge=0, le=1, description="GAE lambda (PPO)")
    value_clip: float = Field(0.2, gt=0, description="critic value clip (PPO)")
    num_critic_only_steps: int = Field(0, ge=0, description="first rollouts that train only the critic (PPO)")
    critic_lr: float | None = Field(None, description="learning rate of the critic (default: --lr)")
    use_tis: bool = Field(False, description="truncated importance sampling between the engines' and the "
                                             "trainer's log-probs")
    tis_clip_low: float = Field(0.0, ge=0, description="lower clip of the TIS weights")
    tis_clip: float = Field(2.0, gt=0, description="upper clip of the TIS weights")
    custom_tis_function_path: str | None = Field(None, description="--use-tis weights of your own "
                                                                   "(trainer/losses.py)")
    use_rollout_logprobs: bool = Field(False, description="use the engines' log-probs as the old policy's instead "
                                                          "of recomputing them")
    # weight sync: the roles read these only through rlslurm/settings/weight_plan.py, which resolves them once into
    # the plan both use (each field there names its consumers); layout.py and resolve.py check them
    weight_sync: Literal["distributed", "disk"] = Field("distributed", description="how new weights reach the "
                                                                                  "engines: a broadcast group, or a "
                                                                                  "checkpoint on disk")
    weight_sync_backend: Literal["auto", "nccl", "gloo"] = Field("auto", description="backend of the weight-sync "
                                                                                     "group (auto: nccl on CUDA, "
                                                                                     "gloo on CPU and with "
                                                                                     "--shared-gpu)")
    weight_sync_transport: Literal["auto", "broadcast", "ipc"] = Field(
        "auto", description="broadcast group, or in place on the same GPU (CUDA IPC, --colocate only); auto: "
                            "ipc with --colocate and PP 1")
    update_weight_buffer_size: int = Field(512 * 1024**2, ge=1024, description="bytes per weight-sync bucket")
    # no faster than one broadcast per tensor for dense models
    # (bench/results/engine-sync-h200x2-flattened.md) and a bucket's extra copy on the trainer's GPU,
    # so off by default (docs/sglang-behaviour.md)
    update_weight_flattened_bucket: bool = Field(False, description="one broadcast per bucket, received as "
                                                                    "SGLang's flattened bucket")
    # engines/receiver.py: one request per publish, overlapped, copies learnt from load_weights; the
    # rollout node then starts SGLang with --custom-weight-loader. `auto` is resolved at submit
    # (weight_plan.py `auto_receiver`): rlslurm's where it is proven on GPUs, SGLang's elsewhere
    update_weight_receiver: Literal["auto", "sglang", "rlslurm"] = Field(
        "auto", description="who loads broadcast weights into an engine: SGLang's per-bucket path, rlslurm's "
                            "receiver (faster), or auto: rlslurm's for qwen3/qwen3-MoE on GPUs (proven there), "
                            "SGLang's elsewhere")
    # the GPU tier runs with off, so a fallback cannot pass for the transport (docs/gpu.md)
    weight_sync_fallback: Literal["disk", "off"] = Field(
        "disk", description="what delivers a version whose transport failed every try: disk (HF files in "
                            "RUN/weights, loaded by each engine that answers; recorded and shown as a fallback) "
                            "or off (the attempt fails and SLURM requeues it)")
    weight_sync_timeout_s: float = Field(300.0, gt=0, description="bound of each weight-sync step; a try that "
                                                                  "passes it fails (then a retry, then "
                                                                  "--weight-sync-fallback)")
    distributed_timeout_minutes: float = Field(60.0, gt=0, description="timeout of every trainer process group "
                                                                       "(trainer/collectives.py)")
    hang_timeout_minutes: float | None = Field(None, ge=0, description="end the attempt when a role's heartbeat "
                                                                       "is silent this long (default: "
                                                                       "distributed timeout + 10; 0: off)")
    verify_weight_sync: bool = Field(False, description="after each sync, compare trainer and engine greedy output "
                                                        "(control/weight_probe.jsonl)")
    load_debug_rollout_data: Path | None = Field(None, description="replay: train from another run's buffer "
                                                                   "directory, no engines")
    debug_rollout_only: bool = Field(False, description="generate and keep every rollout, train nothing "
                                                        "(trainer/rollout_only.py)")
    # With a replay it changes nothing; without one the rollout node builds the rollouts itself with
    # the --rollout-function-path function (default SFT: rollout/sft.py)
    debug_train_only: bool = Field(False, description="slime's flag: start no engines (SFT, or a replay)")
    # rlslurm/trainer/replay_subsample.py
    load_debug_rollout_data_subsample: float | None = Field(None, gt=0, le=1, description="replay this fraction "
                                                                                          "of each rollout's "
                                                                                          "groups")


class RunConfig(Section):
    run: RunSection = Field(default_factory=RunSection)
    slurm: SlurmSection = Field(default_factory=SlurmSection)
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    train: TrainSection = Field(default_factory=TrainSection)
    megatron: dict[str, Any] = Field(default_factory=dict, description="--megatron-<field> VALUE passthrough: "
                                                                       "megatron-core config fields")
    sglang_args: list[str] = Field(default_factory=list, description="--sglang-<flag> [VALUE] passthrough to every "
                                                                     "SGLang server, argv form")
    router_args: list[str] = Field(default_factory=list, description="--router-<flag> [VALUE] passthrough to "
                                                                     "sglang-router, argv form")

    # Derived from the fields above (and filled by rlslurm/resolve.py `_derive`).
    @property
    def trainer_gpus(self) -> int:
        return self.slurm.trainer_nodes * self.trainer_procs_per_node  # type: ignore[operator]

    @property
    def trainer_procs_per_node(self) -> int:
        return self.slurm.trainer_procs_per_node or max(self.slurm.gpus_per_node, 1)

    @property
    def shares_gpus(self) -> bool:
        """The trainer and the engines on the same GPUs: --colocate, or `rlslurm run --shared-gpu`."""
        return self.run.colocate or self.run.shared_gpu

    @property
    def single_node(self) -> bool:
        """--nodes 1: the trainer and the rollout share one node, each on its own GPUs (docs/single-node.md)."""
        return self.slurm.nodes == 1 and not self.run.colocate

    @property
    def gpu_split_flags(self) -> tuple[str, str]:
        """The flags that set the trainer's and the engines' GPUs per node, for error messages."""
        return ("--trainer-gpus", "--rollout-gpus") if self.single_node else ("--trainer-procs-per-node",
                                                                                "--gpus-per-node")

    @property
    def rollout_gpus_per_node(self) -> int:
        """GPUs of each rollout node that its engines use: all of them, or on one node the rollout's share."""
        return (self.slurm.rollout_gpus or 0) if self.single_node else self.slurm.gpus_per_node

    @property
    def rollout_gpus(self) -> int:
        return self.slurm.rollout_nodes * self.rollout_gpus_per_node  # type: ignore[operator]

    @property
    def starts_no_engines(self) -> bool:
        """A replay of another run's buffer, or --debug-train-only: the rollout group starts no engine."""
        return self.train.debug_train_only or self.train.load_debug_rollout_data is not None

    @property
    def builds_without_engines(self) -> bool:
        """--debug-train-only without a replay: rollouts come from an engine-free rollout function (SFT)."""
        return self.train.debug_train_only and self.train.load_debug_rollout_data is None

    @property
    def run_dir(self) -> Path:
        return run_dir_of(self.run.run_dir, self.run.run_name)


SECTIONS: tuple[str, ...] = ("run", "slurm", "model", "data", "rollout", "train")
