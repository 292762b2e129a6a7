"""Submit-time checks of what the nodes would otherwise find only after the queue wait.

`resolve()` runs these; each raises a one-line ConfigError naming the flag. What this host cannot
know stays for the nodes, where a user error ends the job without requeue (docs/user-errors.md):
* a plugin whose import needs a module that is not installed here is a warning when the job runs
  another Python environment (--python, --setup-script, --env PYTHONPATH, a container), which
  may have it; every other import failure is an error;
* `--sglang-*` flags are checked against this host's SGLang only when the job runs this host's
  Python environment (job_env_is_ours); `--megatron-*` fields likewise, read from megatron-core's
  source without importing it (importing takes seconds), and the installed stack (check_stack).
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rlslurm.errors import ConfigError, DataError, UserError
from rlslurm.settings.flags import flag_name

if TYPE_CHECKING:
    from rlslurm.settings.config import RunConfig
    from rlslurm.settings.model_config import ModelConfig

# Plugin flag -> positional arguments its callable must take (None: a class or factory, checked by
# the node that builds it). The same numbers the rollout's loaders use.
PLUGIN_ARGS: dict[str, int | None] = {
    "custom_rm_path": 1,                   # rollout/rewards.py
    "custom_generate_function_path": 3,    # rollout/generate_api.py
    "rollout_function_path": 1,            # rollout/rollout_fn.py
    "dynamic_sampling_filter_path": 1,     # rollout/filters.py
    "buffer_filter_path": None,            # rollout/data.py
    "data_source_path": None,              # rollout/data.py
    "custom_loss_function_path": 1,        # trainer/actor_loss.py
    "custom_advantage_function_path": 1,   # trainer/advantages.py
    "rollout_sample_filter_path": 1,       # rollout/filters.py
    "custom_reward_post_process_path": 2,  # trainer/advantages.py
    "custom_tis_function_path": 1,         # trainer/losses.py
}


def job_env_is_ours(cfg: "RunConfig") -> bool:
    """Whether the job's processes run this host's Python environment: then what is not installed
    here is not installed there either."""
    s = cfg.slurm
    same_python = s.python is None or Path(s.python).resolve() == Path(sys.executable).resolve()
    return (same_python and s.setup_script is None and not s.container_image and not s.apptainer_image
            and "PYTHONPATH" not in s.env)


# ------------------------------------------------------------------------------------ plugins


def check_plugins(cfg: "RunConfig", warnings: list[str]) -> None:
    """Import every plugin as the rollout will (a file plugin is executed, as on the node)."""
    from rlslurm.plugins import load_callable, load_object

    for name, min_args in PLUGIN_ARGS.items():
        spec = plugin_spec(cfg, name)
        if not spec:
            continue
        flag = flag_name(name)
        try:
            if min_args is None:
                load_object(spec, what=flag)
            else:
                load_callable(spec, what=flag, min_args=min_args)
        except UserError as e:
            missing = _missing_module(e)
            if missing is None or job_env_is_ours(cfg):
                raise
            warnings.append(f"{flag} {spec}: not checked here, module {missing!r} is not installed on this host "
                            f"(the job's environment must have it)")
    check_rollout_hooks(cfg, warnings)


def check_rollout_hooks(cfg: "RunConfig", warnings: list[str]) -> None:
    """What the rollout driver checks when it loads --rollout-function-path and a fan-out
    --custom-generate-function-path (async; @fan_out(k) divides the group sizes, no partial
    rollout), run here so that the job does not fail at its start."""
    from rlslurm.rollout.driver import check_fan_out
    from rlslurm.rollout.generate_api import load_generate_fn
    from rlslurm.rollout.rollout_fn import load_rollout_fn

    r = cfg.rollout
    try:
        if r.rollout_function_path:
            load_rollout_fn(r.rollout_function_path)
        if r.custom_generate_function_path:
            check_fan_out(load_generate_fn(r.custom_generate_function_path), cfg)
    except UserError as e:
        if _missing_module(e) is None or job_env_is_ours(cfg):
            raise  # a missing module was warned about by check_plugins already


def plugin_spec(cfg: "RunConfig", name: str) -> str | None:
    """The value of plugin field `name`, whichever section holds it."""
    return getattr(cfg.rollout, name, None) or getattr(cfg.data, name, None) or getattr(cfg.train, name, None)


def _missing_module(e: BaseException) -> str | None:
    """The module name when `e` (or its cause) is a ModuleNotFoundError."""
    cause = e.__cause__
    return cause.name if isinstance(cause, ModuleNotFoundError) else None


# ------------------------------------------------------------------------------------ W&B

_WANDB_FIELDS = ("wandb_mode", "wandb_project", "wandb_group", "wandb_team", "wandb_host", "wandb_dir", "wandb_run_id")
WANDB_KEY_ENV = "WANDB_API_KEY"


def wandb_run_id(run_name: str, run_dir: Path) -> str:
    """The default --wandb-run-id: the run name (cut to what an id takes) and a hash of the run
    directory, so two runs of one name in different directories are different W&B runs."""
    import hashlib
    import re

    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", run_name).strip("-.")[:40] or "run"
    digest = hashlib.sha256(str(Path(run_dir).absolute()).encode()).hexdigest()[:8]
    return f"{slug}-{digest}"


def check_wandb(cfg: "RunConfig", warnings: list[str]) -> None:
    """--wandb-* only with --use-wandb; wandb importable where the job runs; a key for online mode."""
    r = cfg.run
    if not r.use_wandb:
        for name in _WANDB_FIELDS:
            if getattr(r, name) is not None:
                raise ConfigError(f"{flag_name(name)} needs --use-wandb (without it nothing is logged to W&B)")
        return
    if r.wandb_mode == "disabled":
        return
    if importlib.util.find_spec("wandb") is None:
        msg = ("--use-wandb: the wandb package is not installed on this host (pip install wandb, or "
               "--wandb-mode disabled)")
        if job_env_is_ours(cfg):
            raise ConfigError(msg)
        warnings.append(f"{msg}; the job runs another environment, which must have it")
    mode = r.wandb_mode or cfg.slurm.env.get("WANDB_MODE", "online")
    if mode == "online" and WANDB_KEY_ENV not in cfg.slurm.secret_env and not _netrc_has(r.wandb_host):
        warnings.append(f"--use-wandb: no W&B key for the job ({WANDB_KEY_ENV} is not passed and ~/.netrc has no "
                        f"entry): export {WANDB_KEY_ENV} and add --secret-env {WANDB_KEY_ENV}, or use "
                        "--wandb-mode offline (docs/wandb.md)")


def _netrc_has(host: str | None) -> bool:
    """Whether ~/.netrc (where `wandb login` keeps the key) has the W&B server; the nodes see it
    when home directories are shared."""
    import netrc
    from urllib.parse import urlparse

    machine = urlparse(host).hostname if host else "api.wandb.ai"
    try:
        return netrc.netrc().authenticators(machine) is not None
    except (OSError, netrc.NetrcParseError):
        return False


# ------------------------------------------------------------------------------------ stack


def check_stack(cfg: "RunConfig", mc: "ModelConfig", warnings: list[str], notes: list[str]) -> None:
    """The torch, megatron-core, SGLang and transformer-engine each role will run, against the supported
    stacks (rlslurm/stacks.py), where the job runs this environment: the roles would refuse them at
    their start, after the queue wait. Another environment is checked there, by each role."""
    from rlslurm import stacks

    if not job_env_is_ours(cfg):
        notes.append("the job runs another Python environment: each role checks its torch, megatron-core, SGLang "
                     f"and transformer-engine against the supported stacks at its start ({stacks.DOC})")
        return
    for role in ("trainer", "rollout"):
        stacks.check_run_role(role, cfg, model=mc, warnings=warnings)


# ------------------------------------------------------------------------------------ colocate


def check_colocate(cfg: "RunConfig", warnings: list[str], *, strict: bool) -> None:
    """--colocate on GPUs starts the engines with --enable-memory-saver (rollout/node.py
    colocate_args), with which SGLang raises at start-up when torch_memory_saver cannot be imported:
    the job would fail only after its queue wait. An error where the job runs this environment
    (a dry run: a warning), else a warning."""
    if not (cfg.run.colocate and cfg.run.device == "cuda") or importlib.util.find_spec("torch_memory_saver"):
        return
    msg = ("--colocate on GPUs: the engines give their memory to the trainer only through torch_memory_saver "
           "(SGLang's --enable-memory-saver), which is not installed on this host (pip install torch_memory_saver)")
    if not job_env_is_ours(cfg):
        warnings.append(f"{msg}; the job runs another environment, which must have it")
    elif strict:
        raise ConfigError(msg)
    else:
        warnings.append(msg)


def check_dsa_engine(cfg: "RunConfig", mc: "ModelConfig", warnings: list[str], *, strict: bool) -> None:
    """A sparse-attention model's engines on CUDA need deep_gemm beside SGLang (engines/dsa_deps.py): an
    error where the job runs this environment and its SGLang (a dry run: a warning); elsewhere the
    rollout node checks its own."""
    from rlslurm.engines.dsa_deps import dsa_engine_refusal
    from rlslurm.engines.sglang_versions import installed_sglang_version

    if cfg.starts_no_engines or not job_env_is_ours(cfg):
        return
    if (why := dsa_engine_refusal(mc, cfg.run.device, installed_sglang_version())) is None:
        return
    if strict:
        raise ConfigError(why)
    warnings.append(why)


# ------------------------------------------------------------------------------------ sglang


def check_engine_dtype(cfg: "RunConfig") -> None:
    """GPU engines cannot run float32: SGLang's CUDA rmsnorm (sgl_kernel) has no float32 kernel and the
    engine dies at its first forward, after the queue wait (docs/gpu.md). `rlslurm run --demo` asks
    float32 for its exact CPU checks, so `--device cuda` needs --rollout-dtype bfloat16 there. (SGLang's
    `--dtype auto` serves a float32 checkpoint in float16, so only an explicit float32 is refused.)"""
    dtype = cfg.rollout.rollout_dtype
    if cfg.run.device == "cuda" and not cfg.starts_no_engines and dtype in ("float32", "float"):
        raise ConfigError(f"--rollout-dtype {dtype} with --device cuda: SGLang's CUDA kernels (sgl_kernel rmsnorm) "
                          "have no float32, and the engines would die at their first forward; pass --rollout-dtype "
                          "bfloat16")


def sglang_table(cfg: "RunConfig"):
    """The installed SGLang's parser table (engines/sglang_flags.py), where the job runs this host's
    SGLang and there is a passthrough to read with it; else None (the rollout node reads it again)."""
    from rlslurm.engines import sglang_flags, sglang_versions

    if not cfg.sglang_args or not job_env_is_ours(cfg) or sglang_versions.installed_sglang_version() is None:
        return None
    return sglang_flags.sglang_parser_table()


def sglang_passthrough(cfg: "RunConfig"):
    """cfg.sglang_args as SGLang reads them, --config file expanded (engines/sglang_args.py)."""
    from rlslurm.engines.sglang_args import read_passthrough

    return read_passthrough(cfg.sglang_args, sglang_table(cfg))


def check_sglang_args(cfg: "RunConfig", warnings: list[str]) -> None:
    """No flag (or --sglang-config key) that rlslurm sets, none SGLang does not know: on the values the
    installed SGLang resolves, where the job runs it."""
    from rlslurm.engines import sglang_flags, sglang_versions

    table = sglang_table(cfg)
    p = sglang_passthrough(cfg)
    sglang_flags.check_owned(p, table)
    if not p.flags():
        return
    if table is None:
        version = sglang_versions.installed_sglang_version()
        why = "SGLang is not installed on this host" if version is None else "the job runs another environment"
        warnings.append(f"--sglang-* flags ({' '.join(w for _, w in p.flags())}) not checked here: {why}"
                        f"; the rollout nodes check them")
        return
    unknown = sglang_flags.unknown_flags(p, table)
    if unknown:
        raise ConfigError(sglang_flags.unknown_flags_message(unknown, table,
                                                             sglang_versions.installed_sglang_version()))
    if (wrong := sglang_flags.value_count_error(p, table)) is not None:
        raise ConfigError(wrong)


def check_router_args(cfg: "RunConfig", warnings: list[str]) -> None:
    """--router-<flag> passthrough (sglang-router's launcher flags, e.g. --router-policy cache_aware):
    not one rlslurm sets itself, and a flag of the installed router where this host can tell."""
    from rlslurm.engines import router, sglang_flags

    router.check_owned(cfg.router_args)
    flags = sglang_flags.passthrough_flags(cfg.router_args)
    if not flags:
        return
    installed = importlib.util.find_spec("sglang_router") is not None
    if not installed or not job_env_is_ours(cfg):
        why = "the job runs another environment" if installed else "sglang-router is not installed on this host"
        warnings.append(f"--router-* flags ({' '.join(flags)}) not checked here: {why}"
                        "; the rollout node's router checks them")
        return
    known = router.router_cli_flags()
    unknown = [f for f in flags if f not in known]
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(known), n=1)
        raise ConfigError(f"--router-{unknown[0][2:]}: the installed sglang-router has no {unknown[0]}"
                          + (f" (did you mean --router-{close[0][2:]}?)" if close else ""))


# ------------------------------------------------------------------------------------ megatron

_MEGATRON_FILES = ("model_parallel_config.py", "transformer/transformer_config.py", "optimizer/optimizer_config.py")


def megatron_fields(mla: bool) -> frozenset[str] | None:
    """The fields `--megatron-<field>` may set (trainer/setup.split_megatron_overrides): the
    TransformerConfig's (MLATransformerConfig's for MLA models) and the OptimizerConfig's, read from
    the installed megatron-core's source; None when it is not installed or laid out otherwise."""
    spec = importlib.util.find_spec("megatron.core") if importlib.util.find_spec("megatron") else None
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(list(spec.submodule_search_locations)[0])
    classes: dict[str, tuple[list[str], list[str]]] = {}
    try:
        for rel in _MEGATRON_FILES:
            classes.update(_dataclass_fields(root / rel))
    except (OSError, SyntaxError):
        return None

    def fields(name: str) -> list[str]:
        bases, own = classes[name]
        return [f for b in bases if b in classes for f in fields(b)] + own

    wanted = ("MLATransformerConfig" if mla else "TransformerConfig", "OptimizerConfig")
    if not all(w in classes for w in wanted):
        return None
    return frozenset(f for w in wanted for f in fields(w))


def _dataclass_fields(path: Path) -> dict[str, tuple[list[str], list[str]]]:
    """class name -> (base class names, annotated class attributes) of a module's top level."""
    out = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef):
            bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
            own = [s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                   and not _is_classvar(s.annotation)]
            out[node.name] = (bases, own)
    return out


def _is_classvar(annotation: ast.expr) -> bool:
    node = annotation.value if isinstance(annotation, ast.Subscript) else annotation
    return ((isinstance(node, ast.Name) and node.id == "ClassVar")
            or (isinstance(node, ast.Attribute) and node.attr == "ClassVar"))


def check_megatron_fields(cfg: "RunConfig", mc: "ModelConfig", warnings: list[str]) -> None:
    if not cfg.megatron:
        return
    import difflib

    known = megatron_fields(mla=bool(mc.arch.mla))
    if known is None or not job_env_is_ours(cfg):
        why = "megatron-core is not installed on this host" if known is None else "the job runs another environment"
        warnings.append(f"--megatron-* fields not checked here: {why}"
                        "; the trainer checks them")
        return
    for key in cfg.megatron:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean --megatron-{close[0].replace('_', '-')}?)" if close else ""
            raise ConfigError(f"--megatron-{key.replace('_', '-')}: {key!r} is not a megatron-core "
                              f"TransformerConfig or OptimizerConfig field{hint}")


def check_transformer_impl(cfg: "RunConfig", warnings: list[str]) -> None:
    """--transformer-impl transformer_engine where transformer-engine cannot run: one line. --device cpu
    always; not installed or outside megatron-core's range where the job runs this environment, else a
    warning (the trainer checks it where it runs: models/build.py). rlslurm/settings/transformer_impl.py."""
    from rlslurm.settings.transformer_impl import FLAG, TE, te_refusal

    impl, device = cfg.train.transformer_impl, cfg.run.device
    if impl != TE:
        return
    if device == "cpu" or job_env_is_ours(cfg):
        if (why := te_refusal(impl, device=device)) is not None:
            raise ConfigError(why)
    else:
        warnings.append(f"{FLAG} {TE}: transformer-engine not checked here (the job runs another environment); "
                        "the trainer refuses it there if it is missing or outside megatron-core's range")


# ------------------------------------------------------------------------------------ checkpoints, CP


def check_hf_dir(flag: str, path: Path, mc: "ModelConfig", warnings: list[str]) -> str | None:
    """An HF model directory the trainer and the engines can load: config.json matching the model
    config, and safetensors weights. Returns a one-line note for a block-wise FP8 one. Needs no torch:
    on a host without transformers config.json is compared as written (models/hf_config.py FileConfig),
    and what it leaves out is left to the trainer, with a warning."""
    from rlslurm.convert.hf_io import INDEX_NAME
    from rlslurm.models.hf_config import check_hf_config

    if not path.is_dir():
        raise ConfigError(f"{flag} {path}: not a directory (a Hugging Face model directory is expected)")
    if not (path / "config.json").is_file():
        raise ConfigError(f"{flag} {path}: no config.json, so not a Hugging Face model directory")
    from rlslurm.settings.low_precision import checkpoint_precision

    # before the weights: block-wise FP8 is noted, any other quantization refused for what it is
    note = checkpoint_precision(flag, path)
    if not (path / INDEX_NAME).is_file() and not any(path.glob("*.safetensors")):
        raise ConfigError(f"{flag} {path}: no *.safetensors weights (nor {INDEX_NAME})")
    try:
        unchecked = check_hf_config(mc, path)
    except UserError as e:
        raise ConfigError(f"{flag} {path}: {e}") from None
    if unchecked:
        warnings.append(f"{flag} {path}: transformers is not installed here, so config.json was read as written; "
                        f"what it leaves out ({', '.join(dict.fromkeys(unchecked))}) takes transformers' defaults, "
                        "which the trainer checks on the node")
    return note


SFT_CHECKED_RECORDS = 20


def check_sft_data(cfg: "RunConfig", warnings: list[str]) -> None:
    """SFT rollouts (rollout/sft.py): the loss masks of the first records of --prompt-data, built here with
    the --hf-checkpoint tokenizer's chat template, so a record or template that cannot be masked is
    refused (file:line) before the job waits in the queue."""
    d, hf = cfg.data, cfg.model.hf_checkpoint
    if hf is None or not Path(hf).is_dir() or d.prompt_data is None:
        return
    try:
        from transformers import AutoTokenizer
    except ImportError:
        warnings.append("--debug-train-only: transformers is not installed here; the SFT records' loss masks are "
                        "built on the rollout node only")
        return
    from rlslurm.rollout.data import PromptSource
    from rlslurm.rollout.sft import check_chat_template, sft_sample

    try:
        tok = AutoTokenizer.from_pretrained(str(hf))
    except Exception as e:
        raise ConfigError(f"--hf-checkpoint {hf}: cannot load its tokenizer: {e}") from None
    check_chat_template(tok)
    src = PromptSource(d.prompt_data, input_key=d.input_key, label_key=None, metadata_key=d.metadata_key,
                       tool_key=d.tool_key, tokenizer=tok, shuffle=False, strict=d.data_strict)
    try:
        for prompt in src.take(SFT_CHECKED_RECORDS):
            try:
                sft_sample(tok, prompt, d.apply_chat_template_kwargs)
            except DataError as e:
                if d.data_strict:
                    raise
                warnings.append(f"{e} (--no-data-strict: such records are skipped)")
    finally:
        src.close()


def check_replay_buffer(path: Path) -> None:
    """--load-debug-rollout-data: a run directory whose buffer has committed rollouts to train from."""
    from rlslurm.buffer.reader import RolloutReader

    try:
        RolloutReader.replay(path)
    except UserError as e:
        raise ConfigError(f"--load-debug-rollout-data {path}: {e}") from None


# Memory-backed filesystems: each node has its own, and it is gone with the node's reboot.
NODE_MEMORY_FS = frozenset({"tmpfs", "ramfs"})
# Directories that are each node's own by convention (a login node's /tmp is not a compute node's).
NODE_LOCAL_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/user")


def node_local_run_dir(run_dir: Path) -> str | None:
    """Why `run_dir` is likely not shared with the job's nodes, or None. `rlslurm submit` writes the run
    directory here and the job's nodes read and write it there (run.yaml, the buffer, control/): a
    directory that only this node has splits the run. Said for submit only: `rlslurm run` runs both
    groups on this machine, where any directory works (docs/shared-filesystem.md)."""
    from rlslurm.buffer.atomic import filesystem_of

    path = Path(os.path.abspath(run_dir))
    mount, fstype = filesystem_of(path)
    local = next((d for d in (*NODE_LOCAL_DIRS, os.environ.get("TMPDIR")) if d and
                  (str(path) == d.rstrip("/") or str(path).startswith(d.rstrip("/") + "/"))), None)
    if fstype not in NODE_MEMORY_FS and local is None:
        return None
    what = f"a {fstype} (each node's own memory, at {mount})" if fstype in NODE_MEMORY_FS else \
        f"under {local}, which is local to each node"
    return (f"--run-dir {path} is {what}: the job's nodes would not see what submit writes there, nor each "
            f"other's files; give a --run-dir on storage every node mounts at the same path "
            f"(docs/shared-filesystem.md)")
