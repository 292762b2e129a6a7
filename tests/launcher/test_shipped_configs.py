"""Every shipped model config resolves and renders at every node count it has defaults for, and
the layout rules that used to let a shipped default through to a job that refuses it at start
(docs/parallel-layouts.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlslurm.errors import ConfigError
from rlslurm.model_config import available_models, load_model_config
from rlslurm.resolve import resolve
from rlslurm.slurm.render import render
from tests.hf_shape import hf_shaped_dir
from tests.prompt_files import prompt_lines

SHIPPED = [(model, nodes) for model in available_models() for nodes in sorted(load_model_config(model).defaults)]


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    p = tmp_path / "train.jsonl"
    p.write_text(prompt_lines())
    return p


def test_every_shipped_config_has_node_counts() -> None:
    assert {m for m, _ in SHIPPED} == set(available_models())
    assert ("deepseek-v3", 40) in SHIPPED  # the node count its note in the YAML explains


@pytest.mark.parametrize("model, nodes", SHIPPED, ids=[f"{m}@{n}" for m, n in SHIPPED])
def test_shipped_defaults_resolve_and_render(tmp_path: Path, prompts: Path, model: str, nodes: int) -> None:
    """What `rlslurm submit --model M --nodes N` checks with real inputs, at the defaults' own N:
    no error and no warning (the memory check included), and a script for all N nodes."""
    hf = hf_shaped_dir(tmp_path / "hf", model)
    res = resolve(["--model", model, "--nodes", str(nodes), "--prompt-data", str(prompts),
                   "--hf-checkpoint", str(hf), "--run-dir", str(tmp_path / "run")])
    assert res.warnings == []
    defaults = load_model_config(model).defaults[nodes]
    s = res.cfg.slurm
    assert (s.trainer_nodes, s.rollout_nodes) == (defaults["trainer_nodes"], defaults["rollout_nodes"])
    trainer, rollout = render(res.cfg, res.cfg.run_dir).split("#SBATCH hetjob")
    assert f"#SBATCH --nodes={s.trainer_nodes}\n" in trainer and f"#SBATCH --nodes={s.rollout_nodes}\n" in rollout


def _gpu_argv(prompts: Path, *extra: str) -> list[str]:
    return ["--model", "glm4-9B", "--nodes", "4", "--prompt-data", str(prompts), "--hf-checkpoint",
            str(hf_shaped_dir(prompts.parent / "hf", "glm4-9B")), *extra]


def test_engine_larger_than_a_node_is_refused(prompts: Path) -> None:
    """16 GPUs per engine on 2 rollout nodes of 8 divide the 16 rollout GPUs, but rollout/node.py
    starts engines on one node's GPUs only: refused at submit, naming both flags."""
    with pytest.raises(ConfigError) as e:
        resolve(_gpu_argv(prompts, "--rollout-num-gpus-per-engine", "16"))
    msg = str(e.value)
    assert "\n" not in msg
    assert msg == ("--rollout-num-gpus-per-engine 16 is more than --gpus-per-node 8: engines spanning nodes are "
                   "not supported yet (each engine runs within one node)")
    with pytest.raises(ConfigError, match=r"--rollout-num-gpus-per-engine 8 is more than --gpus-per-node 4"):
        resolve(_gpu_argv(prompts, "--gpus-per-node", "4", "--rollout-num-gpus-per-engine", "8"))
    # a whole node is one engine's most
    assert resolve(_gpu_argv(prompts, "--rollout-num-gpus-per-engine", "8")).cfg.rollout.rollout_num_gpus_per_engine == 8


def test_expert_grid_counts_tensor_parallelism(prompts: Path) -> None:
    """Megatron makes the experts tensor-parallel as the dense layers: TP=2 x EP=2 needs 4 ranks,
    so 2 trainer processes are refused (megatron-core's initialize_model_parallel raises there)."""
    argv = ["--model", "tiny-qwen3-moe", "--prompt-data", str(prompts)]
    with pytest.raises(ConfigError) as e:
        resolve(argv + ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"])
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("--expert-model-parallel-size 2 x --tensor-model-parallel-size 2 ")
    assert "--pipeline-model-parallel-size 1 = 4 does not divide the 2 trainer GPUs" in msg
    for ok in (["--expert-model-parallel-size", "2"], ["--tensor-model-parallel-size", "2"]):
        resolve(argv + ok)
