"""Het-group 1: the rollout side.

Real SGLang servers (one per `gpus_per_engine` GPUs, or one per pinned core on CPU) supervised
by `supervisor.EngineSupervisor`, behind one real `sglang-router` (`router.RouterProcess`);
`sglang_client` is the typed HTTP client every other part of the package uses to talk to them.
On CPU, `sglang_cpu` is the only place that knows how SGLang is made to run without a GPU.
"""
