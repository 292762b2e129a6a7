"""`rlslurm run --device cuda` on one machine gives each group its own GPUs (trainer first), as the het
job gives each its own nodes; too few GPUs is a one-line error before anything starts."""

from __future__ import annotations

import pytest

from rlslurm.errors import ConfigError
from rlslurm.gpus import split_gpus, visible_gpus
from tests.prompt_files import prompt_lines


def test_each_group_sees_its_own_gpus_first_and_the_others_after() -> None:
    assert split_gpus(["0", "1"], 1, 1) == (["0", "1"], ["1", "0"])
    assert split_gpus(["3", "5", "6", "7"], 2, 2) == (["3", "5", "6", "7"], ["6", "7", "3", "5"])
    assert split_gpus(["0", "1", "2"], 1, 1) == (["0", "1", "2"], ["1", "0", "2"])


def test_too_few_gpus_names_both_flags() -> None:
    with pytest.raises(ConfigError, match=r"--trainer-procs-per-node.*--gpus-per-node.*need 3 GPUs, 2 visible"):
        split_gpus(["0", "1"], 2, 1)


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert visible_gpus() == ["2", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []


def test_a_replay_run_needs_gpus_for_the_trainer_only(tmp_path, monkeypatch) -> None:
    """--load-debug-rollout-data starts no engines, so one GPU is enough (it was refused before)."""
    from rlslurm.gpus import group_gpus
    from rlslurm.buffer import RolloutWriter, RunDir
    from rlslurm.resolve import resolve
    from tests.buffer.helpers import make_meta, make_samples
    from tests.hf_shape import hf_shaped_dir

    (tmp_path / "p.jsonl").write_text(prompt_lines())
    RolloutWriter(RunDir.create(tmp_path / "replay")).commit(0, make_samples(0), make_meta(0))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    base = ["--model", "tiny-qwen3", "--prompt-data", str(tmp_path / "p.jsonl"), "--device", "cuda",
            "--nodes", "2", "--gpus-per-node", "1", "--trainer-procs-per-node", "1",
            "--hf-checkpoint", str(hf_shaped_dir(tmp_path / "hf", "tiny-qwen3"))]  # weights to serve: engines
    with pytest.raises(ConfigError, match="need 2 GPUs, 1 visible"):
        group_gpus(resolve(base, strict_inputs=False).cfg)
    replay = resolve(base + ["--load-debug-rollout-data", str(tmp_path / "replay")], strict_inputs=False).cfg
    assert group_gpus(replay)[0] == ["0"]


def test_shared_gpu_puts_both_groups_on_one_gpu_and_syncs_over_gloo(tmp_path, monkeypatch) -> None:
    """A one-GPU box: --shared-gpu runs the trainer and the engine on GPU 0 as separate processes. NCCL
    refuses two ranks on one GPU, so the weight-sync group is gloo (docs/gpu.md); submit refuses it."""
    from rlslurm.gpus import group_gpus
    from rlslurm.resolve import resolve
    from rlslurm.slurm.render import render
    from rlslurm.trainer.weight_sync import SyncOptions
    from tests.config_errors import one_line_naming
    from tests.hf_shape import hf_shaped_dir

    (tmp_path / "p.jsonl").write_text(prompt_lines())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    base = ["--model", "tiny-qwen3", "--prompt-data", str(tmp_path / "p.jsonl"), "--device", "cuda",
            "--nodes", "2", "--gpus-per-node", "1", "--trainer-procs-per-node", "1",
            "--hf-checkpoint", str(hf_shaped_dir(tmp_path / "hf", "tiny-qwen3"))]
    shared = base + ["--shared-gpu", "--sglang-mem-fraction-static", "0.3"]
    cfg = resolve(shared, strict_inputs=False).cfg
    assert group_gpus(cfg) == (["0"], ["0"])
    assert SyncOptions.from_config(cfg).backend == "gloo"
    assert SyncOptions.from_config(resolve(base, strict_inputs=False).cfg).backend is None  # nccl on CUDA
    with pytest.raises(ConfigError, match="--shared-gpu is for `rlslurm run`"):
        render(cfg, tmp_path / "run")
    one_line_naming(base + ["--shared-gpu"], "--shared-gpu", "--sglang-mem-fraction-static")
    one_line_naming(shared + ["--weight-sync-backend", "nccl"], "--shared-gpu", "--weight-sync-backend nccl")
    one_line_naming(shared + ["--device", "cpu"], "--shared-gpu", "--device cuda")
