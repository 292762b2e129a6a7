"""A MiMo checkpoint names its config class as remote code (config.json auto_map): SGLang reads it only
with --trust-remote-code, so the engines get the flag for such a checkpoint (and only for one), unless
the passthrough already says it (docs/model-families.md, "MiMo-7B (`mimo`, MiMoForCausalLM)")."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    from rlslurm.settings.model_config import load_model_config
    from rlslurm.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("remote_code")
    return {n: make_tiny_checkpoint(load_model_config(n), root / n) for n in ("tiny-mimo", "tiny-qwen2")}


@pytest.mark.parametrize("model, extra, count", [("tiny-mimo", [], 1), ("tiny-qwen2", [], 0),
                                                  ("tiny-mimo", ["--sglang-trust-remote-code"], 1)])
def test_engines_trust_the_remote_code_of_a_remote_code_config(model, extra, count, ckpts, tmp_path) -> None:
    from rlslurm.resolve import resolve
    from rlslurm.rollout.node import engine_specs

    res = resolve(["--model", model, "--hf-checkpoint", str(ckpts[model]), *extra], strict_inputs=False)
    args = engine_specs(res.cfg, node=0, host="127.0.0.1", api_key="k", log_dir=tmp_path)[0].server_args()
    assert args.count("--trust-remote-code") == count, args
