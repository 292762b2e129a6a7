"""The settings of a run: what a run is told, and the rules it is checked against.

- `config`: the one typed `RunConfig`; `flags`, `paths`, `slime_flags`: flags and YAML into it.
- `model_config` and `model_configs/` (package data): a model's architecture and defaults (one built
  from a checkpoint's config.json: rlslurm/models/model_from_hf.py).
- `eval_config`, `prompt_slice`, `rm_types`, `rl_settings`, `low_precision`: what some settings mean
  and the rules across them.
- `layout`, `parallel_grid`: where each group runs and how the trainer's GPUs are split;
  `weight_plan`: the weight-sync settings resolved once for both roles.
- `runfile`: RUN/run.yaml, read by every process.

Below both roles and the login side: nothing here imports them. A config is assembled and checked
for a run by rlslurm/resolve.py (with rlslurm/preflight.py, its submit-time checks), on the login
side (tests/launcher/test_package_layout.py).

Nothing is imported here: each module is imported by its own path.
"""
