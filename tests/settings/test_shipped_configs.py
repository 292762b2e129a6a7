"""Every shipped model config resolves and renders at every node count it has defaults for, and
the layout rules that used to let a shipped default through to a job that refuses it at start
(docs/parallel-layouts.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlslurm.resolve import resolve
from rlslurm.settings.model_config import available_models, load_model_config
from rlslurm.slurm.render import render
from tests.helpers.config_errors import one_line_naming
from tests.helpers.hf_shape import hf_shaped_dir

SHIPPED = [(model, nodes) for model in available_models() for nodes in sorted(load_model_config(model).defaults)]


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


def test_engines_spanning_nodes_resolve_only_in_whole_nodes(prompts: Path) -> None:
    """An engine larger than a node spans whole rollout nodes (engines/span.py): 16 GPUs per engine on
    2 rollout nodes of 8 is one engine over both; what cannot be laid out is refused at submit with one
    line naming the flags, and so are DP-attention/EP sizes that do not divide the engine."""
    from rlslurm.rollout.node import engines_total, nodes_per_engine

    cfg = resolve(_gpu_argv(prompts, "--rollout-num-gpus-per-engine", "16")).cfg
    assert (nodes_per_engine(cfg), engines_total(cfg)) == (2, 1)
    cfg = resolve(_gpu_argv(prompts, "--gpus-per-node", "4", "--rollout-num-gpus-per-engine", "8")).cfg
    assert (nodes_per_engine(cfg), engines_total(cfg)) == (2, 1)
    assert nodes_per_engine(resolve(_gpu_argv(prompts, "--rollout-num-gpus-per-engine", "8")).cfg) == 1
    one_line_naming(_gpu_argv(prompts, "--rollout-num-gpus-per-engine", "24"),
                    "--rollout-num-gpus-per-engine 24 spans 3 rollout nodes", "--rollout-nodes 2")
    one_line_naming(_gpu_argv(prompts, "--rollout-num-gpus-per-engine", "12"),
                    "--rollout-num-gpus-per-engine 12 is more than --gpus-per-node 8 and not a multiple")
    colocated = resolve(_gpu_argv(prompts, "--rollout-num-gpus-per-engine", "16", "--colocate", "--nodes", "2"),
                        strict_inputs=False).cfg
    assert (nodes_per_engine(colocated), engines_total(colocated)) == (2, 1)  # on the trainer's 2 nodes
    one_line_naming(_gpu_argv(prompts, "--nodes", "1", "--rollout-gpus", "4", "--trainer-gpus", "4",
                              "--rollout-num-gpus-per-engine", "8"),
                    "--rollout-num-gpus-per-engine 8", "--nodes 1")
    span = _gpu_argv(prompts, "--rollout-num-gpus-per-engine", "16")
    # DP attention across nodes opens SGLang's ZMQ ports between them: the user says how they are closed
    resolve(span + ["--sglang-enable-dp-attention", "--sglang-dp-size", "4", "--sglang-ep-size", "16",
                    "--engine-span-ports-closed"])
    one_line_naming(span + ["--sglang-dp-size", "2"], "--sglang-dp-size 2", "--sglang-enable-dp-attention")
    one_line_naming(span + ["--sglang-enable-dp-attention", "--sglang-dp-size", "3", "--engine-span-ports-closed"],
                    "--sglang-dp-size 3",
                    "16 GPUs")
    one_line_naming(span + ["--sglang-ep-size", "6"], "--sglang-ep-size 6", "--rollout-num-gpus-per-engine 16")
    one_line_naming(span + ["--sglang-nnodes", "2"], "--sglang-nnodes")


def test_cpu_engines_span_one_rank_per_node(prompts: Path) -> None:
    """--device cpu: an engine of N ranks runs one on each of N rollout nodes (the CI stand-in)."""
    from rlslurm.rollout.node import engines_total, nodes_per_engine

    argv = ["--model", "tiny-qwen3", "--prompt-data", str(prompts), "--nodes", "3", "--trainer-nodes", "1",
            "--rollout-nodes", "2", "--engines-per-node", "1"]
    cfg = resolve(argv + ["--rollout-num-gpus-per-engine", "2"]).cfg
    assert (nodes_per_engine(cfg), engines_total(cfg)) == (2, 1)
    one_line_naming(argv[:-1] + ["2", "--rollout-num-gpus-per-engine", "2"], "--engines-per-node 1", "got 2")
    one_line_naming(argv + ["--rollout-num-gpus-per-engine", "3"], "spans 3 rollout nodes", "--rollout-nodes 2")


def test_expert_grid_counts_tensor_parallelism(prompts: Path) -> None:
    """Megatron makes the experts tensor-parallel as the dense layers unless told otherwise: TP=2 x
    EP=2 needs 4 ranks, so 2 trainer processes are refused (megatron-core's
    initialize_model_parallel raises there)."""
    argv = ["--model", "tiny-qwen3-moe", "--prompt-data", str(prompts)]
    msg = one_line_naming(argv + ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"],
                          "--expert-model-parallel-size 2 x --expert-tensor-parallel-size 2 (default: "
                          "--tensor-model-parallel-size) x --pipeline-model-parallel-size 1 = 4 does not divide "
                          "the 2 trainer GPUs")
    assert msg.startswith("--expert-model-parallel-size 2 x ")
    for ok in (["--expert-model-parallel-size", "2"], ["--tensor-model-parallel-size", "2"]):
        resolve(argv + ok)


def test_expert_tensor_parallel_size_is_its_own(prompts: Path) -> None:
    """--expert-tensor-parallel-size (slime's): the experts' grid is ETP x EP x PP (docs/parallel-
    layouts.md). slime's MoE layout, experts whole (ETP 1) under TP 2, fits where ETP = TP does not;
    what megatron-core would refuse at start is refused here, one line naming the flag."""
    argv = ["--model", "tiny-qwen3-moe", "--prompt-data", str(prompts), "--tensor-model-parallel-size", "2"]
    cfg = resolve(argv + ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]).cfg
    assert (cfg.train.expert_tensor_parallel_size, cfg.train.expert_tp) == (1, 1)
    assert resolve(argv).cfg.train.expert_tp == 2  # unset: TP, as before
    one_line_naming(argv + ["--expert-tensor-parallel-size", "4"],
                    "--expert-model-parallel-size 1 x --expert-tensor-parallel-size 4 x "
                    "--pipeline-model-parallel-size 1 = 4 does not divide the 2 trainer GPUs")
    one_line_naming(argv[:-1] + ["1", "--trainer-procs-per-node", "3", "--expert-tensor-parallel-size", "3"],
                    "--expert-tensor-parallel-size 3 does not divide tiny-qwen3-moe's expert FFN width 32")
    one_line_naming(argv + ["--megatron-expert-tensor-parallel-size", "1"],
                    "--megatron-expert-tensor-parallel-size", "use --expert-tensor-parallel-size")
    one_line_naming(argv + ["--megatron-tensor-model-parallel-size", "1"], "use --tensor-model-parallel-size")
    one_line_naming(argv + ["--expert-tensor-parallel-size", "0"], "--expert-tensor-parallel-size")


def test_uneven_pipeline_stages(tmp_path: Path, prompts: Path) -> None:
    """--decoder-first/last-pipeline-num-layers (slime's): PP need not divide the layers; what
    megatron-core would refuse at build or start is refused at submit, one line naming the flags
    (rlslurm/settings/parallel_grid.py stage_layers, docs/parallel-layouts.md "Pipeline stages")."""
    import yaml

    from rlslurm.settings.model_config import MODEL_CONFIG_DIR

    raw = yaml.safe_load((MODEL_CONFIG_DIR / "tiny-qwen3.yaml").read_text())
    raw["name"], raw["arch"]["num_layers"] = "tiny-qwen3-5", 5
    (tmp_path / "tiny5.yaml").write_text(yaml.safe_dump(raw))
    argv = ["--model", str(tmp_path / "tiny5.yaml"), "--prompt-data", str(prompts), "--trainer-procs-per-node", "4"]
    pp2, pp4 = ["--pipeline-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "4"]
    first, last = "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"
    one_line_naming(argv + pp2, "--pipeline-model-parallel-size 2 does not divide tiny-qwen3-5's 5 layers", first)
    t = resolve(argv + pp2 + [first, "2"]).cfg.train
    assert (t.decoder_first_pipeline_num_layers, t.decoder_last_pipeline_num_layers) == (2, None)
    resolve(argv + pp4 + [first, "1", last, "2"])
    one_line_naming(argv + pp4 + [first, "1", last, "1"], f"{first} 1 and {last} 1 at --pipeline-model-parallel-size "
                    "4: the 2 other stages would share 3 of tiny-qwen3-5's 5 layers, which does not divide evenly")
    one_line_naming(argv + pp2 + [first, "2", last, "2"], "the 0 other stages would hold 1 of tiny-qwen3-5's 5 layers")
    one_line_naming(argv + [last, "2"], f"{last} 2: needs --pipeline-model-parallel-size > 1")
    one_line_naming(argv + pp2 + [last, "0"], last)
    one_line_naming(argv + pp2 + ["--megatron-num-layers-in-first-pipeline-stage", "2"], f"use {first}")
    one_line_naming(argv + pp2 + [first, "2", "--megatron-account-for-embedding-in-pipeline-split", "true"],
                    "--megatron-account-for-embedding-in-pipeline-split: rlslurm splits the layers")
    one_line_naming(argv + pp4 + [first, "1", last, "2", "--megatron-virtual-pipeline-model-parallel-size", "2"],
                    "--megatron-virtual-pipeline-model-parallel-size: the interleaved schedule")


def test_gpu_runs_of_slime_sized_models_recompute_as_slime_does(tmp_path: Path, prompts: Path) -> None:
    """slime's scripts all run full activation recompute; qwen3-4B at TP 2 without it ran out of memory
    on an 80 GB H100 (docs/gpu.md). The user's flags win key by key, and a granularity other than full
    drops the config's full-only keys (megatron-core refuses them beside selective); a CPU run and a
    model measured without it (qwen3-1.7B) get none."""
    def megatron(model: str, *extra: str) -> dict:
        argv = ["--model", model, "--nodes", "2", "--prompt-data", str(prompts), "--hf-checkpoint",
                str(hf_shaped_dir(tmp_path / model, model)), "--run-dir", str(tmp_path / "run"), *extra]
        return resolve(argv).cfg.megatron

    slime = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    assert megatron("qwen3-4B") == slime
    selective = megatron("qwen3-4B", "--megatron-recompute-granularity", "selective")
    assert selective == {"recompute_granularity": "selective"}
    assert megatron("qwen3-4B", "--megatron-recompute-granularity", "full") == slime  # the README's line
    assert megatron("qwen3-4B", "--megatron-recompute-num-layers", "2") == {**slime, "recompute_num_layers": 2}
    assert megatron("qwen3-4B", "--megatron-fp16") == {**slime, "fp16": True}
    assert megatron("qwen3-4B", "--device", "cpu", "--engines-per-node", "1") == {}
    assert megatron("qwen3-1.7B") == {}
