"""The SGLang engines, shared by both roles: what runs them and what talks to them.

The rollout role (het-group 1) starts and supervises them: `engine.EngineProcess` (launched as
`python -m rlslurm.engines.engine MODULE ...`, which also starts the router), `router.RouterProcess`,
`supervisor.EngineSupervisor`, and `update_watch.UpdateWatcher`, which pauses the supervisor's
health checks while the trainer writes weights. The trainer role (het-group 0) writes weights into
them through `fanout.Engines` (one HTTP call to every engine at once) and reads back their greedy
output after a sync through `greedy` (`--verify-weight-sync`). `sglang_client` is the
typed HTTP client both use; `sglang_versions` and `sglang_flags` are what rlslurm knows about
SGLang's versions and flags; on CPU, `sglang_cpu` is the only place that knows how SGLang is made
to run without a GPU.

This package imports neither `rlslurm.rollout` nor `rlslurm.trainer` (tests/launcher/test_package_layout.py).
"""
