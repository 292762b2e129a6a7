"""--nodes 1 (docs/single-node.md): both groups on one node, its --gpus-per-node split between the
trainer (--trainer-gpus) and the engines (--rollout-gpus); a job of one group whose two steps share
the node (--overlap), each taking its own GPUs of the job's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rlslurm.gpus import step_gpus
from rlslurm.resolve import resolve
from rlslurm.slurm.render import render
from tests.helpers.config_errors import one_line_naming
from tests.helpers.hf_shape import hf_shaped_dir
from tests.helpers.prompt_files import prompt_lines


@pytest.fixture
def argv(tmp_path: Path) -> list[str]:
    prompts = tmp_path / "train.jsonl"
    prompts.write_text(prompt_lines({"prompt": "1+1=", "label": "2"}))
    return ["--model", "qwen3-4B", "--nodes", "1", "--prompt-data", str(prompts),
            "--hf-checkpoint", str(hf_shaped_dir(tmp_path / "hf", "qwen3-4B"))]


def test_one_node_splits_its_gpus_and_renders_one_group(argv: list[str], tmp_path: Path) -> None:
    cfg = resolve(argv).cfg
    s = cfg.slurm
    assert (s.trainer_nodes, s.rollout_nodes, s.trainer_gpus, s.rollout_gpus) == (1, 1, 4, 4)
    assert (cfg.trainer_procs_per_node, cfg.trainer_gpus, cfg.rollout_gpus) == (4, 4, 4)
    script = render(cfg, tmp_path / "run")
    assert "#SBATCH hetjob" not in script and "--het-group" not in script
    assert script.count("#SBATCH --nodes=1") == 1 and "#SBATCH --gpus-per-node=8" in script
    assert script.count("srun --overlap ") == 2
    # the rest of the one given; a replay or SFT run (no engines) gives the trainer the node
    cfg = resolve(argv + ["--rollout-gpus", "6"]).cfg
    assert (cfg.slurm.trainer_gpus, cfg.slurm.rollout_gpus, cfg.trainer_procs_per_node) == (2, 6, 2)
    cfg = resolve(argv + ["--gpus-per-node", "4", "--trainer-gpus", "1", "--tensor-model-parallel-size", "1"]).cfg
    assert (cfg.slurm.trainer_gpus, cfg.slurm.rollout_gpus) == (1, 3)


def test_each_step_takes_its_own_gpus_of_the_jobs(argv: list[str], monkeypatch) -> None:
    cfg = resolve(argv + ["--rollout-gpus", "6"]).cfg
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")  # what SLURM gives each --overlap step
    assert step_gpus(cfg, "trainer") == "0,1,2,3,4,5,6,7"
    assert step_gpus(cfg, "rollout") == "2,3,4,5,6,7,0,1"  # its own first: engines number them from 0
    two = resolve(argv[:2] + ["--nodes", "2"] + argv[4:]).cfg
    assert step_gpus(two, "trainer") is None and step_gpus(two, "rollout") is None  # a het group's node is its own
    # --device cpu with gres GPUs (the SLURM test cluster's device files): split all the same; none given: no split
    cpu = resolve(argv + ["--rollout-gpus", "6", "--device", "cpu", "--engines-per-node", "1"]).cfg
    assert step_gpus(cpu, "rollout") == "2,3,4,5,6,7,0,1"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr("rlslurm.gpus._nvidia_smi", lambda: ())
    assert step_gpus(cpu, "rollout") is None


def test_bad_one_node_layouts_are_one_line_errors(argv: list[str]) -> None:
    one_line_naming(argv + ["--trainer-gpus", "4", "--rollout-gpus", "2"], "--trainer-gpus 4", "--rollout-gpus 2",
                    "--gpus-per-node 8")
    one_line_naming(argv + ["--trainer-gpus", "8"], "--nodes 1", "--gpus-per-node 8", "(0)", "--rollout-gpus")
    one_line_naming(argv + ["--trainer-nodes", "2"], "--trainer-nodes 2", "--nodes 1", "--trainer-gpus")
    one_line_naming(argv + ["--gpus-per-node", "4", "--rollout-gpus", "2", "--rollout-num-gpus-per-engine", "4"],
                    "--rollout-num-gpus-per-engine 4", "--rollout-gpus 2")
    one_line_naming(argv + ["--gpus-per-node", "4", "--rollout-gpus", "3", "--tensor-model-parallel-size", "1",
                            "--rollout-num-gpus-per-engine", "2"],
                    "--rollout-num-gpus-per-engine 2", "--rollout-gpus 3")
    one_line_naming(argv + ["--trainer-procs-per-node", "2"], "--trainer-procs-per-node 2", "--trainer-gpus 4")
    one_line_naming(argv + ["--trainer-partition", "a", "--rollout-partition", "b"], "--trainer-partition a",
                    "--rollout-partition b", "--nodes 1")
    two = argv[:2] + ["--nodes", "2"] + argv[4:]
    one_line_naming(two + ["--trainer-gpus", "4"], "--trainer-gpus", "--nodes 2", "--trainer-nodes")


def test_a_model_config_without_a_one_node_entry_lends_its_smallest(tmp_path: Path) -> None:
    """tiny-qwen3 defines defaults for 2 nodes: one node takes them without the node split."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(prompt_lines())
    cfg = resolve(["--model", "tiny-qwen3", "--nodes", "1", "--prompt-data", str(prompts)], strict_inputs=False).cfg
    assert (cfg.run.device, cfg.trainer_procs_per_node, cfg.rollout.engines_per_node) == ("cpu", 2, 2)
    assert (cfg.slurm.trainer_nodes, cfg.slurm.rollout_nodes) == (1, 1)
    # on GPUs the placement gives the trainer its GPUs: the config's CPU process count (2) does not
    # stand against it (`rlslurm run --demo --colocate --device cuda --gpus-per-node 1` was refused)
    gpu = ["--model", "tiny-qwen3", "--device", "cuda", "--prompt-data", str(prompts), "--num-epoch", "100"]
    colocated = resolve(gpu + ["--colocate", "--nodes", "1", "--gpus-per-node", "1"], strict_inputs=False).cfg
    assert colocated.trainer_procs_per_node == 1
    split = resolve(gpu + ["--nodes", "1", "--gpus-per-node", "2"], strict_inputs=False).cfg
    assert (split.trainer_procs_per_node, split.slurm.rollout_gpus) == (1, 1)


@pytest.fixture
def memory_saver(tmp_path: Path, monkeypatch) -> None:
    """torch_memory_saver importable here (GPU engines need it with --colocate; this host need not
    have it): a package of that name on the path."""
    pkg = tmp_path / "site" / "torch_memory_saver"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "torch_memory_saver", raising=False)


def test_colocate_on_gpus_without_torch_memory_saver_is_refused_at_submit(argv: list[str], monkeypatch) -> None:
    """SGLang raises at start with --enable-memory-saver and no torch_memory_saver: after the queue wait."""
    monkeypatch.setitem(sys.modules, "torch_memory_saver", None)  # not importable, whatever this host has
    one_line_naming(argv + ["--colocate"], "--colocate", "torch_memory_saver")
    dry = resolve(argv + ["--colocate"], strict_inputs=False)  # a dry run: a warning
    assert any("torch_memory_saver" in w for w in dry.warnings), dry.warnings
    other = resolve(argv + ["--colocate", "--python", "/opt/other/bin/python3"])  # the job's own environment
    assert any("another environment" in w for w in other.warnings), other.warnings


def test_colocate_puts_both_groups_on_every_node_and_refuses_what_cannot_take_turns(argv: list[str], tmp_path: Path,
                                                                                    memory_saver) -> None:
    """--colocate (docs/colocate.md): one group of --nodes; both steps --overlap on all of them, the
    engines on the trainer's own GPUs (SLURM's CUDA_VISIBLE_DEVICES, no split), weights over gloo."""
    from rlslurm.rollout.node import colocate_args
    from rlslurm.settings.weight_plan import weight_sync_plan

    two = argv[:2] + ["--nodes", "2", "--colocate"] + argv[4:]
    cfg = resolve(two).cfg
    s = cfg.slurm
    assert (s.trainer_nodes, s.rollout_nodes, cfg.trainer_gpus, cfg.rollout_gpus) == (2, 2, 16, 16)
    script = render(cfg, tmp_path / "run")
    assert "#SBATCH hetjob" not in script and script.count("#SBATCH --nodes=2") == 1
    assert script.count("srun --overlap --kill-on-bad-exit=1 --nodes=2 ") == 2
    assert step_gpus(cfg, "trainer") is None and step_gpus(cfg, "rollout") is None
    assert weight_sync_plan(cfg).backend == "gloo" and colocate_args(cfg) == ("--enable-memory-saver",)
    # weights in place on each GPU (trainer/weights/ipc.py): the engines load rlslurm's receiver for it
    from rlslurm.engines.receiver import LOADER
    from rlslurm.rollout.node import receiver_args

    assert weight_sync_plan(cfg).transport == "ipc"
    assert receiver_args(weight_sync_plan(cfg)) == ("--custom-weight-loader", LOADER)
    bc = resolve(two + ["--weight-sync-transport", "broadcast"]).cfg
    assert weight_sync_plan(bc).transport == "broadcast" and receiver_args(weight_sync_plan(bc)) == ()
    pp = resolve(two + ["--pipeline-model-parallel-size", "2"]).cfg  # a stage holds part of the model
    assert weight_sync_plan(pp).transport == "broadcast"
    one_line_naming(two + ["--pipeline-model-parallel-size", "2", "--weight-sync-transport", "ipc"],
                    "--weight-sync-transport ipc", "--pipeline-model-parallel-size 2")
    split = argv[:4] + ["--trainer-gpus", "4"] + argv[4:]
    assert weight_sync_plan(resolve(split).cfg).transport == "broadcast"
    one_line_naming(split + ["--weight-sync-transport", "ipc"], "--weight-sync-transport ipc", "--colocate")
    assert resolve(argv + ["--colocate"]).cfg.slurm.rollout_nodes == 1  # one node, colocated

    one_line_naming(two + ["--async-buffer-size", "1"], "--async-buffer-size 1", "--colocate")
    one_line_naming(two + ["--rollout-nodes", "1"], "--rollout-nodes 1", "--colocate", "--nodes 2")
    one_line_naming(two + ["--trainer-gpus", "4"], "--trainer-gpus", "--colocate")
    one_line_naming(two + ["--weight-sync-backend", "nccl"], "--colocate", "--weight-sync-backend nccl")
    one_line_naming(two + ["--trainer-procs-per-node", "4"], "--trainer-procs-per-node 4", "--gpus-per-node 8")
    one_line_naming(two + ["--shared-gpu"], "--colocate", "--shared-gpu")
    # --offload-train / --no-offload-train: unset (None), the trainer decides what fits (trainer/offload_choice.py)
    assert resolve(two).cfg.run.offload_train is None
    assert resolve(two + ["--no-offload-train"]).cfg.run.offload_train is False
    one_line_naming(split + ["--no-offload-train"], "--no-offload-train", "--colocate")
    one_line_naming(split + ["--offload-train"], "--offload-train", "--colocate")
    one_line_naming(two + ["--debug-rollout-only"], "--colocate", "--debug-rollout-only")
