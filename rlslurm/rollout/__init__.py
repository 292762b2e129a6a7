"""Het-group 1: the rollout side.

The rollout node starts the engines (real SGLang servers, one per `gpus_per_engine` GPUs, or
one per pinned core on CPU) and one real `sglang-router` in front of them, all from
`rlslurm.engines`; the driver generates through the router (`router_context.RouterContext`),
scores, filters and commits rollouts to the run directory. It does not import `rlslurm.trainer`.
"""
