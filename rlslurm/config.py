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

from rlslurm.prompt_slice import parse_prompt_spec
from rlslurm.rl_settings import ESTIMATOR_NAMES, LOSS_TYPE_NAMES
from rlslurm.rm_types import RM_REFUSED, RM_TYPES
from rlslurm.secret_env import looks_secret
from rlslurm.slurm.timespec import time_limit_s

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


class RunSection(Section):
    run_name: str = "rlslurm"
    run_dir: Path | None = None          # default: ./runs/<run_name>
    seed: int = 1234
    device: Literal["cuda", "cpu"] = "cuda"
    group_shared: bool = False           # run dir 0750 + setgid instead of 0700
    # `rlslurm run` only: the trainer and the engines share this machine's GPU(s) as separate processes
    # (a one-GPU box); weight sync then goes over gloo, NCCL refuses two ranks on one GPU (docs/gpu.md)
    shared_gpu: bool = False
    # slime's --colocate: the trainer and the engines on the same GPUs of every node, taking turns
    # (engines release their memory while the trainer trains; docs/colocate.md)
    colocate: bool = False
    # Weights & Biases (slime's flags; docs/wandb.md). Read by rlslurm/metrics_sink.py only; the
    # API key is never a field: WANDB_API_KEY goes through --secret-env (docs/security.md).
    use_wandb: bool = False
    wandb_mode: Literal["online", "offline", "disabled"] | None = None   # None: WANDB_MODE in --env, else online
    wandb_project: str | None = None
    wandb_group: str | None = None       # default: --run-name
    wandb_team: str | None = None        # W&B entity
    wandb_host: str | None = None        # W&B server (self-hosted), e.g. https://wandb.example.org
    wandb_dir: Path | None = None        # default: RUN/wandb
    # Base of the two runs' ids (<id>-trainer, <id>-rollout); resolve derives it from the run
    # name and directory, and run.yaml keeps it, so every attempt resumes the same runs.
    wandb_run_id: str | None = None

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
    nodes: int = Field(2, ge=1)
    trainer_nodes: int | None = Field(None, ge=1)
    rollout_nodes: int | None = Field(None, ge=1)
    gpus_per_node: int = Field(8, ge=0)
    # --nodes 1 only: how the node's --gpus-per-node are split (slime's --actor-num-gpus-per-node and
    # --rollout-num-gpus); default half each, or the rest of the one given (docs/single-node.md)
    trainer_gpus: int | None = Field(None, ge=1)
    rollout_gpus: int | None = Field(None, ge=0)
    trainer_procs_per_node: int | None = Field(None, ge=1)  # default: gpus_per_node (CPU: set explicitly)
    cpus_per_node: int | None = Field(None, ge=1)
    mem: str | None = None
    partition: str | None = None
    trainer_partition: str | None = None
    rollout_partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str = "24:00:00"
    exclusive: bool = True
    container_image: str | None = None     # pyxis/enroot --container-image
    container_mounts: str | None = None    # pyxis/enroot --container-mounts
    apptainer_image: str | None = None     # runs every step as `apptainer exec --nv IMAGE ...`
    signal_grace_s: int = Field(300, ge=30)    # USR1 this long before the time limit
    max_failures: int = Field(3, ge=0)         # requeues after failures (preemptions do not count)
    python: str | None = None                  # interpreter on the nodes; default: the submitting one
    setup_script: Path | None = None           # sourced by every step before python (module load, venv)
    env: dict[str, str] = Field(default_factory=dict)
    # Names passed by file, not by run.yaml (rlslurm/secret_env.py): secret-looking --env names
    # are moved here at validation; a name only listed here takes its value from the environment.
    secret_env: list[str] = Field(default_factory=list)
    sbatch_extra: list[str] = Field(default_factory=list)  # extra `--key=value` sbatch options

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

    @field_validator("sbatch_extra")
    @classmethod
    def _extra(cls, v: list[str]) -> list[str]:
        for opt in v:
            if not re.fullmatch(r"--[a-z][a-z0-9-]*(=[A-Za-z0-9_.,:@+=/%-]*)?", opt):
                raise ValueError(f"{opt!r}: extra sbatch options must look like --key=value with a plain value")
        return v


class ModelSection(Section):
    model: str = "tiny-qwen3"
    hf_checkpoint: Path | None = None   # HF directory: initial actor/ref weights + tokenizer
    ref_load: Path | None = None        # reference model (default: hf_checkpoint)
    load: Path | None = None            # Megatron dist checkpoint to start from (default: RUN/checkpoints)


class DataSection(Section):
    prompt_data: Path | None = None
    input_key: str = "prompt"
    label_key: str | None = "label"
    metadata_key: str | None = None
    tool_key: str | None = None
    apply_chat_template: bool = False
    apply_chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    rollout_shuffle: bool = True
    rollout_seed: int = 42
    num_epoch: int = Field(1, ge=1)
    max_prompt_len: int | None = Field(None, ge=1)
    data_strict: bool = True
    data_source_path: str | None = None   # module:Class of a custom prompt source
    eval_prompt_data: list[str] = Field(default_factory=list)  # NAME PATH [NAME PATH ...]
    eval_config: Path | None = None   # slime's per-dataset eval YAML, instead of eval_prompt_data (rlslurm/eval_config.py)

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
    num_rollout: int = Field(100, ge=0)
    rollout_batch_size: int = Field(32, ge=1)      # prompts per rollout
    n_samples_per_prompt: int = Field(8, ge=1)
    over_sampling_batch_size: int | None = Field(None, ge=1)
    # slime's --partial-rollout: groups cut off by an abort (batch full, weight update, preempt) go
    # back to the data source with their tokens so far and are continued, not restarted
    partial_rollout: bool = False
    # ... and tokens that weights older than a sample's newest segment generated get loss_mask 0
    mask_offpolicy_in_partial_rollout: bool = False
    rollout_max_response_len: int = Field(1024, ge=1)
    # prompt + response tokens, at most (slime's name); prompts longer than this - 1 are dropped
    rollout_max_context_len: int | None = Field(None, ge=2)
    # the reward's response text without special tokens (slime's flag; its default is False, rlslurm's
    # reward text has always skipped them: --no-rollout-skip-special-tokens keeps them)
    rollout_skip_special_tokens: bool = True
    rollout_temperature: float = Field(1.0, ge=0)
    rollout_top_p: float = Field(1.0, gt=0, le=1)
    rollout_top_k: int = -1   # SGLang: -1 (the whole vocabulary) or >= 1
    rollout_stop: list[str] = Field(default_factory=list)
    rollout_stop_token_ids: list[int] = Field(default_factory=list)
    rollout_num_gpus_per_engine: int = Field(1, ge=1)
    engines_per_node: int | None = Field(None, ge=1)  # CPU: how many servers per rollout node
    # An engine spanning nodes with --sglang-enable-dp-attention talks between its nodes over SGLang
    # ZMQ ports that take pickled objects from anyone who connects (docs/security.md, "Engines spanning
    # nodes"): refused unless the user names the interface they bind (a network only the job's nodes
    # reach) or states that they are closed otherwise (a firewall, a private job network).
    engine_span_interface: str | None = None
    engine_span_ports_closed: bool = False
    rollout_dtype: str | None = None                  # engines' --dtype, e.g. float32 for exact CPU tests
    rm_type: Literal[RM_TYPES] = "math"  # type: ignore[valid-type]  # rlslurm/rm_types.py; --custom-rm-path wins
    rm_url: str | None = None
    custom_rm_path: str | None = None
    custom_generate_function_path: str | None = None
    # slime's flag: an async function that generates a whole rollout instead of the driver's group loop
    # (rollout/rollout_fn.py)
    rollout_function_path: str | None = None
    dynamic_sampling_filter_path: str | None = None
    rollout_sample_filter_path: str | None = None     # samples not trained on (rollout/filters.py)
    buffer_filter_path: str | None = None
    reward_key: str | None = None
    rollout_max_concurrency: int = Field(256, ge=1)
    async_buffer_size: int = Field(0, ge=0)           # 0: synchronous (generate N, train N, sync)
    update_weights_interval: int = Field(1, ge=1)
    engine_health_interval_s: float = Field(10.0, gt=0)
    eval_interval: int | None = Field(None, ge=1)
    # slime's flag: no eval at rollout 0 (the weights before training); later evals are unchanged
    skip_eval_before_train: bool = False
    n_samples_per_eval_prompt: int = Field(1, ge=1)
    eval_temperature: float = Field(0.0, ge=0)
    eval_max_response_len: int | None = Field(None, ge=1)
    eval_top_p: float | None = Field(None, gt=0, le=1)   # None: --rollout-top-p
    eval_top_k: int | None = None                        # None: --rollout-top-k
    # Trained rollouts kept in the buffer after a checkpoint, at least: rollouts a kept checkpoint
    # (--keep-checkpoints) would train again after a fallback stay as well (docs/buffer-retention.md).
    keep_trained_rollouts: int = Field(4, ge=0)
    # Each rollout the trainer retires from the buffer is first written here as JSONL
    # (<kind>-<id>.jsonl, rlslurm/buffer/export.py); None: retired rollouts are deleted.
    export_retired_rollouts: Path | None = None

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
    tensor_model_parallel_size: int = Field(1, ge=1)
    pipeline_model_parallel_size: int = Field(1, ge=1)
    context_parallel_size: int = Field(1, ge=1)
    expert_model_parallel_size: int = Field(1, ge=1)
    micro_batch_size: int = Field(1, ge=1)
    global_batch_size: int | None = Field(None, ge=1)   # default: from the batch identity
    num_steps_per_rollout: int = Field(1, ge=1)
    use_dynamic_batch_size: bool = False
    max_tokens_per_gpu: int | None = Field(None, ge=1)
    # slime's --qkv-format: "thd" packs each micro-batch's samples into one row (no padding; each
    # sample attends within itself; dynamic batching counts real tokens), "bshd" right-pads them
    # (trainer/batching.py, docs/sequence-packing.md). slime's default is thd; ours stays bshd
    # until the packed path is measured on GPU.
    qkv_format: Literal["bshd", "thd"] = "bshd"
    lr: float = Field(1e-6, gt=0)
    min_lr: float = Field(0.0, ge=0)
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    lr_warmup_iters: int = Field(0, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.98, ge=0, lt=1)
    adam_eps: float = Field(1e-8, gt=0)
    clip_grad: float = Field(1.0, ge=0)
    bf16: bool = True
    # None: on whenever the data-parallel size is > 1 (Adam state sharded over DP ranks), on any device.
    use_distributed_optimizer: bool | None = None
    # Rollouts between checkpoints: bounds the work a hard kill (node failure, SIGKILL past KillWait)
    # loses. Preempt, stop, SIGTERM and the end of the run save on their own. null: only those.
    save_interval: int | None = Field(10, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    # megatron's --async-save: a save stalls training only while the state is copied off the model;
    # forked writers write it while the trainer trains on, and `latest` moves once it is complete and
    # verified (trainer/ckpt_writer.py, docs/checkpoints.md). --no-async-save: the trainer waits.
    async_save: bool = True
    # slime's --save-hf: with every periodic checkpoint and at the end, the weights in HF format to
    # this directory, `{rollout_id}` replaced by the last trained rollout (trainer/publish.py export_hf)
    save_hf: str | None = None
    # slime's --save-debug-train-data: per rollout and trainer rank, what the loss is computed from
    # (advantages, returns, old/ref log-probs, masks) as a torch file (trainer/main.py)
    save_debug_train_data: str | None = None

    @field_validator("save_hf")
    @classmethod
    def _save_hf(cls, v: str | None) -> str | None:
        return _check_pattern(v, ("rollout_id",))

    @field_validator("save_debug_train_data")
    @classmethod
    def _save_debug_train_data(cls, v: str | None) -> str | None:
        return _check_pattern(v, ("rollout_id", "rank"))
    # RL
    loss_type: Literal[LOSS_TYPE_NAMES] = "policy_loss"  # type: ignore[valid-type]  # rlslurm/rl_settings.py
    custom_loss_function_path: str | None = None          # --loss-type custom_loss (trainer/actor_loss.py)
    advantage_estimator: Literal[ESTIMATOR_NAMES] = "grpo"  # type: ignore[valid-type]  # rlslurm/rl_settings.py
    custom_advantage_function_path: str | None = None      # replaces the estimator's advantages (trainer/advantages.py)
    custom_reward_post_process_path: str | None = None     # replaces the group baseline (trainer/advantages.py)
    grpo_std_normalization: bool = True
    rewards_normalization: bool = True   # the group baseline at all (slime: --disable-rewards-normalization)
    normalize_advantages: bool = False
    eps_clip: float = Field(0.2, gt=0)
    eps_clip_high: float | None = Field(None, gt=0)
    eps_clip_c: float | None = Field(None, gt=1)
    use_kl_loss: bool = False
    kl_loss_coef: float = Field(0.0, ge=0)
    use_unbiased_kl: bool = False   # the KL loss weighted by the new/old ratio (trainer/losses.kl_estimate)
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = "low_var_kl"
    kl_coef: float = Field(0.0, ge=0)
    entropy_coef: float = Field(0.0, ge=0)
    calculate_per_token_loss: bool = False
    gamma: float = Field(1.0, ge=0, le=1)
    lambd: float = Field(1.0, ge=0, le=1)
    value_clip: float = Field(0.2, gt=0)
    num_critic_only_steps: int = Field(0, ge=0)
    critic_lr: float | None = None
    use_tis: bool = False
    tis_clip_low: float = Field(0.0, ge=0)
    tis_clip: float = Field(2.0, gt=0)
    custom_tis_function_path: str | None = None   # --use-tis weights of one's own (trainer/losses.py)
    use_rollout_logprobs: bool = False
    # weight sync
    weight_sync: Literal["distributed", "disk"] = "distributed"
    # the trainer -> engines broadcast group; auto: nccl on CUDA, gloo on CPU and with --shared-gpu
    weight_sync_backend: Literal["auto", "nccl", "gloo"] = "auto"
    # how weights reach the engines: a broadcast group, or in place on the same GPU (--colocate only:
    # trainer/ipc_sync.py); auto: ipc with --colocate and PP 1, broadcast otherwise
    weight_sync_transport: Literal["auto", "broadcast", "ipc"] = "auto"
    update_weight_buffer_size: int = Field(512 * 1024**2, ge=1024)
    # one broadcast per bucket, received as SGLang's flattened bucket (docs/sglang-behaviour.md): as
    # fast as one per tensor for dense models on 2xH200 (bench/results/engine-sync-h200x2-flattened.md) and a bucket's
    # extra copy on the trainer's GPU, so off by default
    update_weight_flattened_bucket: bool = False
    # who loads the broadcast into the engine: SGLang's per-bucket request + load_weights, or rlslurm's
    # receiver inside the engine (engines/receiver.py: one request per publish, overlapped, copies
    # learnt from load_weights); the rollout node then starts SGLang with --custom-weight-loader
    update_weight_receiver: Literal["sglang", "rlslurm"] = "sglang"
    weight_sync_timeout_s: float = Field(300.0, gt=0)
    distributed_timeout_minutes: float = Field(60.0, gt=0)   # every trainer process group (trainer/collectives.py)
    # the attempt's watchdog (rlslurm/watchdog.py): None = distributed timeout + 10 min, 0 = off
    hang_timeout_minutes: float | None = Field(None, ge=0)
    verify_weight_sync: bool = False   # after each sync compare trainer vs engine greedy output (control/weight_probe.jsonl)
    load_debug_rollout_data: Path | None = None   # replay: train from another run's buffer, no engines
    debug_rollout_only: bool = False   # generate and keep every rollout, train nothing (trainer/rollout_only.py)
    # slime's flag: no engines. With a replay it changes nothing; without one the rollout node builds
    # the rollouts itself with the --rollout-function-path function (default SFT: rollout/sft.py)
    debug_train_only: bool = False
    # ... on this fraction of each replayed rollout's groups (rlslurm/trainer/replay_subsample.py)
    load_debug_rollout_data_subsample: float | None = Field(None, gt=0, le=1)


class RunConfig(Section):
    run: RunSection = Field(default_factory=RunSection)
    slurm: SlurmSection = Field(default_factory=SlurmSection)
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    train: TrainSection = Field(default_factory=TrainSection)
    megatron: dict[str, Any] = Field(default_factory=dict)   # --megatron-<field> passthrough
    sglang_args: list[str] = Field(default_factory=list)     # --sglang-<flag> passthrough, argv form
    router_args: list[str] = Field(default_factory=list)     # --router-<flag> passthrough (sglang-router)

    # Derived, filled by `resolve` (see rlslurm/validate.py).
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
    def weight_transport(self) -> Literal["broadcast", "ipc"]:
        """--weight-sync-transport resolved (layout.check refuses ipc where it cannot work)."""
        t = self.train.weight_sync_transport
        if t == "auto":
            return "ipc" if self.run.colocate and self.train.pipeline_model_parallel_size == 1 else "broadcast"
        return t

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
        return self.run.run_dir or Path("runs") / self.run.run_name


SECTIONS: tuple[str, ...] = ("run", "slurm", "model", "data", "rollout", "train")
