"""Where each group runs, decided before anything else is checked (rlslurm/resolve.py):

- `--nodes N` (N >= 2): a het job, the trainer on --trainer-nodes of their own, the engines on
  --rollout-nodes of their own (default: half each).
- `--nodes 1`: one node, its --gpus-per-node split between the trainer (--trainer-gpus) and the
  engines (--rollout-gpus); docs/single-node.md.
- `--colocate`: every node runs both, on the same GPUs, taking turns; docs/colocate.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlslurm.errors import ConfigError
from rlslurm.settings.config import RunConfig
from rlslurm.settings.flags import flag_name

if TYPE_CHECKING:
    from rlslurm.settings.model_config import ModelConfig


def makes_init_checkpoint(cfg: RunConfig, model: "ModelConfig") -> bool:
    """The run directory gets a random-init HF checkpoint (RUN/hf_init, rlslurm/slurm/submit.py
    `prepare_run_dir`) that the engines serve: a tiny model with neither --hf-checkpoint nor --load."""
    return cfg.model.hf_checkpoint is None and cfg.model.load is None and model.tiny


def no_engines_reason(cfg: RunConfig, model: "ModelConfig | None" = None) -> str | None:
    """Why this run starts no rollout engine, or None. Both the GPU split (rlslurm/gpus.py, before the
    run directory exists: `model` tells whether it will get RUN/hf_init) and the rollout node (after:
    run.yaml names the checkpoint) decide by this. Replay (--load-debug-rollout-data) trains from
    another run's buffer; --debug-train-only builds its rollouts on node 0 without engines; a model
    with no HF weights (only --load) has nothing an engine could serve."""
    if cfg.train.load_debug_rollout_data is not None:
        return "replay run (--load-debug-rollout-data): the trainer reads another run's buffer"
    if cfg.train.debug_train_only:
        return (f"--debug-train-only: node 0 builds the rollouts with {cfg.rollout.rollout_function_path} "
                "(no engines, no router)")
    if cfg.model.hf_checkpoint is None and not (model is not None and makes_init_checkpoint(cfg, model)):
        return "no --hf-checkpoint (the trainer starts from --load): no HF weights to serve"
    return None


def place_groups(cfg: RunConfig) -> None:
    if cfg.run.colocate:
        _colocate(cfg)
    elif cfg.single_node:
        _split_one_node(cfg)


def check(cfg: RunConfig) -> None:
    """What the placement refuses once every setting is known."""
    s = cfg.slurm
    if not cfg.single_node and (s.trainer_gpus is not None or s.rollout_gpus is not None):
        what, why = (("--colocate", "the trainer and the engines share every GPU") if cfg.run.colocate else
                     (f"--nodes {s.nodes}", "each group has nodes of its own: use --trainer-nodes / --rollout-nodes"))
        raise ConfigError(f"--trainer-gpus / --rollout-gpus split one node's GPUs (--nodes 1); with {what} {why}")
    if cfg.run.colocate:
        _check_colocate(cfg)
    elif cfg.run.offload_train is not None:
        flag = "--offload-train" if cfg.run.offload_train else "--no-offload-train"
        raise ConfigError(f"{flag}: only with --colocate (without it the trainer has its GPUs to itself)")
    elif cfg.train.weight_sync_transport == "ipc":
        raise ConfigError("--weight-sync-transport ipc: the engines read the weights in place from the trainer's "
                          "GPUs, which only --colocate puts them on; drop it (the broadcast is used)")


def _one_group(cfg: RunConfig, what: str, why: str) -> None:
    """A job of one group: the trainer and the rollout both run on all of its --nodes, of one partition."""
    s = cfg.slurm
    for name in ("trainer_nodes", "rollout_nodes"):
        if getattr(s, name) not in (None, s.nodes):
            raise ConfigError(f"{flag_name(name)} {getattr(s, name)} with {what}: {why}")
    s.trainer_nodes = s.rollout_nodes = s.nodes
    if s.trainer_partition and s.rollout_partition and s.trainer_partition != s.rollout_partition:
        raise ConfigError(f"--trainer-partition {s.trainer_partition} and --rollout-partition {s.rollout_partition} "
                          f"with {what}: both groups run on the same nodes, of one partition")


def _colocate(cfg: RunConfig) -> None:
    """--colocate: one group of --nodes nodes; the trainer and the rollout each run on all of them."""
    _one_group(cfg, "--colocate", f"the trainer and the engines both run on every one of the --nodes {cfg.slurm.nodes}")


def _check_colocate(cfg: RunConfig) -> None:
    r, s, t = cfg.run, cfg.slurm, cfg.train
    if r.shared_gpu:
        raise ConfigError("--colocate and --shared-gpu: --colocate already puts the engines on the trainer's GPUs "
                          "(and takes turns with them); drop --shared-gpu")
    if cfg.starts_no_engines:
        raise ConfigError("--colocate with --debug-train-only or --load-debug-rollout-data: this run starts no "
                          "engine, so there is nothing to colocate with the trainer")
    if t.debug_rollout_only:
        raise ConfigError("--colocate with --debug-rollout-only: there is no trainer to take turns with")
    if cfg.rollout.async_buffer_size:
        raise ConfigError(f"--async-buffer-size {cfg.rollout.async_buffer_size} with --colocate: the engines "
                          "generate only while the trainer does not train (they share the GPUs), so the next rollout "
                          "cannot be generated during training; use 0 (slime's colocated loop is synchronous too)")
    if t.weight_sync_transport == "ipc" and t.pipeline_model_parallel_size > 1:
        raise ConfigError(f"--weight-sync-transport ipc with --pipeline-model-parallel-size "
                          f"{t.pipeline_model_parallel_size}: each trainer rank hands the engine on its GPU the whole "
                          "model, which a pipeline stage does not hold; use --weight-sync-transport broadcast")
    if t.weight_sync_backend == "nccl":
        raise ConfigError("--colocate with --weight-sync-backend nccl: NCCL refuses two ranks on one GPU (the "
                          "trainer and an engine); leave it auto (gloo) or use gloo")
    if r.device == "cuda" and s.trainer_procs_per_node not in (None, s.gpus_per_node):
        raise ConfigError(f"--trainer-procs-per-node {s.trainer_procs_per_node} with --colocate: the trainer runs on "
                          f"every GPU of the node (--gpus-per-node {s.gpus_per_node}), as the engines do")


def _split_one_node(cfg: RunConfig) -> None:
    """--nodes 1: both groups run on the one node (a job of one group, docs/single-node.md), and its
    --gpus-per-node are split: --trainer-gpus for torchrun's ranks, --rollout-gpus for the engines;
    half each by default, or the rest of the one given. On --device cpu with no GPUs asked, nothing
    is split (processes: --trainer-procs-per-node, --engines-per-node)."""
    _one_group(cfg, "--nodes 1", "the trainer and the rollout share the one node; split its GPUs with "
                                 "--trainer-gpus / --rollout-gpus")
    s = cfg.slurm
    g, t, r = s.gpus_per_node, s.trainer_gpus, s.rollout_gpus
    if g == 0:
        if t or r:
            raise ConfigError("--trainer-gpus / --rollout-gpus split the node's GPUs, but --gpus-per-node is 0")
        return
    if cfg.starts_no_engines:
        if r:
            raise ConfigError(f"--rollout-gpus {r}: this run starts no engine (--debug-train-only or "
                              "--load-debug-rollout-data), so the trainer takes every GPU of the node")
        t, r = g if t is None else t, 0
    elif t is None and r is None:
        t = max(1, g // 2)
        r = g - t
    elif t is None:
        t = g - r
    elif r is None:
        r = g - t
    if t + r != g:
        raise ConfigError(f"--trainer-gpus {t} + --rollout-gpus {r} = {t + r}, not --gpus-per-node {g} "
                          "(the GPUs the job asks of its one node)")
    if t < 1 or (r < 1 and not cfg.starts_no_engines):
        raise ConfigError(f"--nodes 1 --gpus-per-node {g}: the trainer ({t}) and the engines ({r}) need at least one "
                          "GPU each (--trainer-gpus / --rollout-gpus)")
    if cfg.run.device == "cuda":
        if s.trainer_procs_per_node not in (None, t):
            raise ConfigError(f"--trainer-procs-per-node {s.trainer_procs_per_node} with --nodes 1: the trainer runs "
                              f"one process per trainer GPU (--trainer-gpus {t})")
        s.trainer_procs_per_node = t
    s.trainer_gpus, s.rollout_gpus = t, r


def context_parallel_refusal(cfg, mc=None) -> str | None:
    """What --context-parallel-size > 1 cannot be combined with, in one line (None: supported).

    CP runs in rlslurm's own core attention, padded and packed, dense, MoE and MLA models alike
    (docs/context-parallel.md); it all-gathers keys and values, so megatron's other CP
    communication schemes (transformer-engine's) are refused rather than silently replaced. `mc`
    (the model config, when known) is for limits of an architecture; there are none today."""
    t = cfg.train
    cp = t.context_parallel_size
    if cp <= 1:
        return None
    comm = (cfg.megatron or {}).get("cp_comm_type")
    if comm not in (None, "allgather", "all_gather"):
        return (f"--megatron-cp-comm-type {comm}: rlslurm's context-parallel attention (without "
                "transformer-engine) all-gathers keys and values; only allgather is available "
                "(docs/context-parallel.md)")
    return None
    if mc is not None and mc.arch.mla is not None and False:  # XXX
        return (f"--context-parallel-size {cp}: {mc.name} uses multi-latent attention, which rlslurm's "
                "context-parallel attention does not cover (docs/context-parallel.md)")
    return None