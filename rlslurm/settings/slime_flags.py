"""slime's flag spellings that are not rlslurm field names: the ones that mean the same, and what to use
instead of the ones rlslurm deliberately does not have.

rlslurm/settings/flags.py reads both tables: an alias sets its field, and an unknown flag found in
`SLIME_INSTEAD` is refused with the rlslurm way to get the same thing. Flag names are without the
leading `--`, in field form (`_`, not `-`). Names checked against `slime/utils/arguments.py`;
the list for users: docs/slime-flags.md.
"""

from __future__ import annotations

from typing import Any

from rlslurm.settings import low_precision

# slime flag -> (rlslurm field, value). value None: the flag takes its value as the field would;
# otherwise the flag is a switch that sets the field to this value.
SLIME_ALIASES: dict[str, tuple[str, Any]] = {
    # slime: action="store_false", dest="grpo_std_normalization" (Dr.GRPO)
    "disable_grpo_std_normalization": ("grpo_std_normalization", False),
    # slime: action="store_false", dest="rewards_normalization" (no group baseline at all)
    "disable_rewards_normalization": ("rewards_normalization", False),
    # slime drops prompts longer than this at load; so does --max-prompt-len
    "rollout_max_prompt_len": ("max_prompt_len", None),
}

# slime switches whose effect rlslurm always has: accepted (slime's spelling) and ignored.
SLIME_ALWAYS: dict[str, str] = {
    # slime: "Balance estimated training FLOPs between data parallel ranks with karmarkar_karp"
    # (slime/utils/arguments.py); rlslurm/trainer/batching.py balances every step by tokens
    "balance_data": "rlslurm always balances each optimizer step's samples over the data-parallel ranks by "
                    "tokens (longest first onto the rank with the fewest, rlslurm/trainer/batching.py)",
}

_RESUME = "rlslurm resumes from the run directory (rlslurm resubmit RUN)"

# slime offloads the trainer and the engines to share GPUs; rlslurm shares them by turns (--colocate)
_OFFLOAD = ("use --colocate: trainer and engines share the GPUs and take turns, each releasing its memory "
            "to the other (docs/colocate.md)")

# slime flag -> what to use in rlslurm instead (one clause, shown after the flag).
SLIME_INSTEAD: dict[str, str] = {
    # Not a field: rollout ids number the weight versions (version N = after training rollouts 0..N-1),
    # the checkpoints and the buffer, so a run always starts at 0 and a resume always wins
    # (docs/slime-flags.md).
    "start_rollout_id": f"{_RESUME}: the next rollout follows the last trained one, and a new run "
                        "starts at 0; to start from other weights use --load or --hf-checkpoint",
    "actor_num_nodes": "use --trainer-nodes (het group 0) and --rollout-nodes",
    "actor_num_gpus_per_node": "use --gpus-per-node (and --trainer-procs-per-node); on one node, --nodes 1 "
                               "--trainer-gpus",
    "rollout_num_gpus": "use --rollout-nodes (times --gpus-per-node); on one node, --nodes 1 --rollout-gpus",
    "num_gpus_per_node": "use --gpus-per-node",
    "offload": _OFFLOAD,
    "offload_rollout": _OFFLOAD,
    "save": "checkpoints go to RUN/checkpoints (--run-dir); use --save-interval and --keep-checkpoints",
    "model_name": "use --model (a model config name, rlslurm/settings/model_configs)",
    "update_weight_mode": "use --weight-sync distributed|disk",
    "update_weight_transport": "use --weight-sync distributed|disk",
    "update_weight_disk_dir": "--weight-sync disk writes to RUN/weights",
    "group_rm": "decorate the --custom-rm-path function with @rlslurm.rollout.rewards.group_reward",
    "save_debug_rollout_data": "every rollout is kept in RUN/buffer until trained and checkpointed; "
                               "--export-retired-rollouts DIR writes each one there as JSONL before it "
                               "goes, and --load-debug-rollout-data RUN replays a run's buffer",
    "loss_mask_type": "--debug-train-only's SFT rollouts find the assistant tokens from the --hf-checkpoint "
                      "tokenizer's own chat template, whatever the model family (rlslurm/rollout/sft.py)",
    "use_fault_tolerance": "preemption and failures are handled by SLURM requeue (--max-failures)",
    # W&B (docs/wandb.md): --use-wandb and --wandb-{mode,project,group,team,host,dir,run-id} are fields
    "wandb_key": "a key on the command line is kept in shell history and visible in /proc; export "
                 "WANDB_API_KEY and add --secret-env WANDB_API_KEY (docs/security.md)",
    "disable_wandb_random_suffix": "W&B run names carry no random suffix here: <run-name>-trainer and "
                                   "<run-name>-rollout, ids from --wandb-run-id",
    "wandb_always_use_train_step": "the W&B step is always the rollout id; the trainer's optimizer step is "
                                   "in RUN/metrics.jsonl and TensorBoard",
    "log_passrate": "eval logs eval/<name>/pass@k with every eval (k = --n-samples-per-eval-prompt)",
    "use_tensorboard": "the trainer writes TensorBoard scalars to RUN/tb whenever tensorboard is installed",
    "eval_max_context_len": "eval uses --rollout-max-context-len",
    "keep_old_actor": "no third model is kept: the old log-probs are the actor's before the rollout's first "
                      "step, or the engine's with --use-rollout-logprobs",
    "ref_update_interval": "the reference model stays the --ref-load (or --hf-checkpoint) weights for the whole run",
    "disable_compute_advantages_and_returns": "advantages are always computed; --loss-type sft_loss or "
                                              "custom_loss need not use them",
    # FP8/FP4 training (rlslurm/settings/low_precision.py): refused with the reason, never dropped
    **{name: low_precision.WHY_TRAINING for name in low_precision.SLIME_FLAGS},
}


def slime_instead(field_name: str) -> str | None:
    """The hint for a slime flag rlslurm does not have (None when `field_name` is not one)."""
    return SLIME_INSTEAD.get(field_name)
