"""A sparse-attention (DSA) model's engines on CUDA need deep_gemm (sgl-deep-gemm) beside SGLang 0.5.14 and
0.5.23 (rlslurm/engines/dsa_deps.py): without it the engine died at its indexer's construction, after the
queue wait, on every attempt. Refused in one line instead, by the rollout node before it starts engines and
at `rlslurm run` / submit where the job runs this environment."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from rlslurm.engines.dsa_deps import MODULE, PACKAGE, dsa_engine_refusal
from rlslurm.errors import ConfigError
from rlslurm.settings.model_config import load_model_config

DSA, DENSE = load_model_config("tiny-glm-moe-dsa"), load_model_config("tiny-qwen3")


def absent(module: str) -> bool:
    return False


def present(module: str) -> bool:
    return True


def test_a_dsa_model_without_the_module_is_refused_in_one_line_naming_it() -> None:
    for version in ("0.5.14", "0.5.23", "0.5.14+cu130"):
        why = dsa_engine_refusal(DSA, "cuda", version, installed=absent)
        assert why is not None and "\n" not in why, why
        for name in ("tiny-glm-moe-dsa", f"module {MODULE}", f"package {PACKAGE}", version):
            assert name in why, (name, why)


def test_what_needs_no_deep_gemm_passes() -> None:
    assert dsa_engine_refusal(DSA, "cuda", "0.5.14", installed=present) is None
    assert dsa_engine_refusal(DENSE, "cuda", "0.5.14", installed=absent) is None   # no indexer
    assert dsa_engine_refusal(DSA, "cpu", "0.5.23", installed=absent) is None      # the CPU indexer is torch's
    assert dsa_engine_refusal(DSA, "cuda", None, installed=absent) is None         # no SGLang here: the node's
    assert dsa_engine_refusal(DSA, "cuda", "0.5.9", installed=absent) is None      # a release not read


def _installed_sglang_needs_it() -> None:
    from rlslurm.engines.dsa_deps import applies
    from rlslurm.engines.sglang_versions import installed_sglang_version

    if not applies("cuda", installed_sglang_version()) or importlib.util.find_spec(MODULE) is not None:
        pytest.skip(f"this environment's SGLang needs no {MODULE}, or it has it")


def test_rlslurm_run_and_the_rollout_node_refuse_it(prompts: Path, tmp_path: Path) -> None:
    """Resolve (strict, as `rlslurm run`): the error; a dry run's: a warning; the rollout node: the error
    before any engine is specified."""
    from rlslurm.resolve import resolve
    from rlslurm.rollout.node import engine_specs

    _installed_sglang_needs_it()
    argv = ["--model", "tiny-glm-moe-dsa", "--prompt-data", str(prompts), "--device", "cuda", "--gpus-per-node", "2",
            "--run-dir", str(tmp_path / "run")]
    with pytest.raises(ConfigError, match=f"tiny-glm-moe-dsa on --device cuda: .* module {MODULE}, .* {PACKAGE}"):
        resolve(argv)
    res = resolve(argv, strict_inputs=False)
    assert [w for w in res.warnings if f"module {MODULE}" in w], res.warnings
    res.cfg.model.hf_checkpoint = tmp_path  # the node's engines load it; --model gives the architecture
    with pytest.raises(ConfigError, match=f"module {MODULE}"):
        engine_specs(res.cfg, node=0, host="127.0.0.1", api_key="k", log_dir=tmp_path)
    dense = resolve([*argv[:1], "tiny-qwen3", *argv[2:]])
    assert not [w for w in dense.warnings if MODULE in w]
