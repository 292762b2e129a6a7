"""The settings of a run: what a run is told, and the rules it is checked against.

- `config`: the one typed `RunConfig`; `flags`, `paths`, `slime_flags`: flags and YAML into it;
  `model_config`, `model_from_hf` and `model_configs/` (package data): a model's architecture and
  defaults; `eval_config`, `prompt_slice`, `rm_types`, `rl_settings`, `low_precision`: what some
  settings mean and the rules across them; `layout`, `parallel_grid`: where each group runs and how
  the trainer's GPUs are split; `weight_plan`: the weight-sync settings resolved once for both roles;
  `runfile`: RUN/run.yaml, read by every process.
- `resolve` (with `preflight`, its submit-time checks) assembles and checks a config on the login
  side: the two modules here that may import the roles (tests/launcher/test_package_layout.py).

Nothing is imported here: each module is imported by its own path.
"""
