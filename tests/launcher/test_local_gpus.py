"""One machine's GPUs between the two groups (rlslurm/gpus.py `role_gpus`), for every layout that puts
both on one machine, on a faked list of 4 GPUs: `rlslurm run` (the demo's random-init model included,
whose engines were put on the trainer's GPUs: issue 30), TP/DP/PP > 1 trainers, TP > 1 engines,
--shared-gpu, --colocate, a replay, and a `--nodes 1` SLURM job's two steps. Too few GPUs is a
one-line error before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlslurm.errors import ConfigError
from rlslurm.gpus import GpuSplit, assign, device_uuids, normal_uuid, visible_gpus
from tests.helpers.prompt_files import prompt_lines

FOUR = ["0", "1", "2", "3"]


def test_each_group_sees_its_own_gpus_first_and_the_others_after() -> None:
    flags = ("--trainer-procs-per-node", "--gpus-per-node")
    assert assign(GpuSplit(1, 1, False, flags), ["0", "1"]) == (["0", "1"], ["1", "0"])
    assert assign(GpuSplit(2, 2, False, flags), ["3", "5", "6", "7"]) == (["3", "5", "6", "7"], ["6", "7", "3", "5"])
    assert assign(GpuSplit(1, 1, False, flags), ["0", "1", "2"]) == (["0", "1", "2"], ["1", "0", "2"])
    assert assign(GpuSplit(2, 1, True, flags), ["0", "1"]) == (["0", "1"], ["0", "1"])


def test_too_few_gpus_names_both_flags() -> None:
    with pytest.raises(ConfigError, match=r"--trainer-procs-per-node.*--gpus-per-node.*need 3 GPUs, 2 visible"):
        assign(GpuSplit(2, 1, False, ("--trainer-procs-per-node", "--gpus-per-node")), ["0", "1"])


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert visible_gpus() == ["2", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []


def _run_split(tmp_path: Path, monkeypatch, *argv: str, visible: list[str] = FOUR,
               dtype: tuple[str, ...] = ("--rollout-dtype", "bfloat16")) -> tuple[list[str], list[str]]:
    """What `rlslurm run ARGV` hands its two roles (run_local's `gpus`), on a faked machine of `visible`
    GPUs (4 by default): the CLI's own decision, made before the run directory exists."""
    return _run(tmp_path, monkeypatch, *argv, visible=visible, dtype=dtype)["gpus"]


def _run(tmp_path: Path, monkeypatch, *argv: str, visible: list[str] = FOUR,
         dtype: tuple[str, ...] = ("--rollout-dtype", "bfloat16")) -> dict:
    """run_local's keyword arguments for `rlslurm run --demo --device cuda ARGV` (nothing is started)."""
    import rlslurm.local

    seen: dict = {}

    class Done(Exception):
        pass

    def capture(run_dir, **kw):
        seen.update(kw)
        raise Done

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(visible))
    monkeypatch.setattr(rlslurm.local, "run_local", capture)
    tmp_path.mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(tmp_path)
    from rlslurm.cli import app

    result = CliRunner().invoke(app, ["run", "--demo", "--run-dir", str(tmp_path / "run"), "--no-progress",
                                      "--device", "cuda", *dtype, *argv])
    assert isinstance(result.exception, Done), result.output
    seen["run_dir"] = tmp_path / "run"
    return seen


# the layouts of the GPU matrix (tests/gpu/test_layouts.py), each on its own GPUs: (flags, trainer's, rollout's)
SPLIT = {
    "trainer 1 + engine 1 (the demo, random-init model)": (
        ["--gpus-per-node", "1", "--trainer-procs-per-node", "1"], ["0", "1", "2", "3"], ["1", "0", "2", "3"]),
    "trainer TP2 + one TP2 engine": (
        ["--gpus-per-node", "2", "--trainer-procs-per-node", "2", "--tensor-model-parallel-size", "2",
         "--rollout-num-gpus-per-engine", "2"], ["0", "1", "2", "3"], ["2", "3", "0", "1"]),
    "trainer DP2 + two TP1 engines": (
        ["--gpus-per-node", "2", "--trainer-procs-per-node", "2"], ["0", "1", "2", "3"], ["2", "3", "0", "1"]),
    "trainer PP2 + one engine": (
        ["--gpus-per-node", "1", "--trainer-procs-per-node", "2", "--pipeline-model-parallel-size", "2"],
        ["0", "1", "2", "3"], ["2", "0", "1", "3"]),
}


@pytest.mark.parametrize("name", list(SPLIT))
def test_rlslurm_run_gives_the_engines_gpus_of_their_own(name: str, tmp_path: Path, monkeypatch) -> None:
    """Fails on the code before issue 30: the demo's engines got ["0", "1", "2", "3"], the trainer's GPUs."""
    argv, trainer, rollout = SPLIT[name]
    t, r = _run_split(tmp_path, monkeypatch, *argv)
    assert (t, r) == (trainer, rollout)
    engine_gpus, trainer_gpus = int(argv[1]), int(argv[3])  # --gpus-per-node, --trainer-procs-per-node
    assert not set(t[:trainer_gpus]) & set(r[:engine_gpus]), (t, r)


def test_shared_gpu_and_colocate_put_both_groups_on_the_same_gpus(tmp_path: Path, monkeypatch) -> None:
    shared = _run_split(tmp_path / "a", monkeypatch, "--gpus-per-node", "1", "--trainer-procs-per-node", "1",
                        "--shared-gpu")
    assert shared == (FOUR, FOUR)
    import rlslurm.preflight

    # the engines' memory saver is not installed on a CPU machine; what matters here is the split
    monkeypatch.setattr(rlslurm.preflight, "check_colocate", lambda cfg, warnings, strict: None)
    colocated = _run_split(tmp_path / "b", monkeypatch, "--gpus-per-node", "2", "--colocate",
                           "--rollout-num-gpus-per-engine", "2")
    assert colocated == (FOUR, FOUR)


def test_a_resumed_run_splits_as_its_first_attempt(tmp_path: Path, monkeypatch) -> None:
    """The second `rlslurm run` reads run.yaml (its checkpoint is RUN/hf_init by then): the same split."""
    import rlslurm.cli
    from rlslurm.resolve import resolve
    from rlslurm.slurm.submit import prepare_run_dir

    (tmp_path / "run").mkdir(parents=True)
    (tmp_path / "p.jsonl").write_text(prompt_lines())
    res = resolve(["--model", "tiny-qwen3", "--nodes", "2", "--trainer-nodes", "1", "--rollout-nodes", "1",
                   "--device", "cuda", "--gpus-per-node", "2", "--trainer-procs-per-node", "2",
                   "--tensor-model-parallel-size", "2", "--rollout-num-gpus-per-engine", "2",
                   "--prompt-data", str(tmp_path / "p.jsonl"), "--run-dir", str(tmp_path / "run")],
                  strict_inputs=False)
    prepare_run_dir(res)
    monkeypatch.setattr(rlslurm.cli, "_clear_stop", lambda p: None)
    assert _run_split(tmp_path, monkeypatch) == (FOUR, ["2", "3", "0", "1"])


def test_a_replay_run_needs_gpus_for_the_trainer_only(tmp_path, monkeypatch) -> None:
    """--load-debug-rollout-data starts no engines, so one GPU is enough."""
    from rlslurm.buffer import RolloutWriter, RunDir
    from rlslurm.gpus import role_gpus
    from rlslurm.resolve import resolve
    from tests.buffer.helpers import make_meta, make_samples
    from tests.helpers.hf_shape import hf_shaped_dir

    (tmp_path / "p.jsonl").write_text(prompt_lines())
    RolloutWriter(RunDir.create(tmp_path / "replay")).commit(0, make_samples(0), make_meta(0))
    base = ["--model", "tiny-qwen3", "--prompt-data", str(tmp_path / "p.jsonl"), "--device", "cuda",
            "--nodes", "2", "--gpus-per-node", "1", "--trainer-procs-per-node", "1",
            "--hf-checkpoint", str(hf_shaped_dir(tmp_path / "hf", "tiny-qwen3"))]  # weights to serve: engines
    with pytest.raises(ConfigError, match="need 2 GPUs, 1 visible"):
        role_gpus(resolve(base, strict_inputs=False).cfg, visible=["0"])
    replay = resolve(base + ["--load-debug-rollout-data", str(tmp_path / "replay")], strict_inputs=False).cfg
    assert role_gpus(replay, visible=["0"])[0] == ["0"]


def test_one_node_slurm_steps_split_a_random_init_run_too(tmp_path: Path, monkeypatch) -> None:
    """--nodes 1 in SLURM: each step's launcher picks its GPUs from run.yaml (written with RUN/hf_init)."""
    from rlslurm.gpus import step_gpus
    from rlslurm.resolve import resolve
    from rlslurm.settings.runfile import load_run_config
    from rlslurm.slurm.submit import prepare_run_dir

    (tmp_path / "p.jsonl").write_text(prompt_lines())
    res = resolve(["--model", "tiny-qwen3", "--nodes", "1", "--device", "cuda", "--gpus-per-node", "4",
                   "--trainer-gpus", "2", "--rollout-num-gpus-per-engine", "2", "--tensor-model-parallel-size", "2",
                   "--prompt-data", str(tmp_path / "p.jsonl"), "--run-dir", str(tmp_path / "run")],
                  strict_inputs=False)
    prepare_run_dir(res)
    cfg = load_run_config(tmp_path / "run")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")  # what SLURM gives each --overlap step
    assert (step_gpus(cfg, "trainer"), step_gpus(cfg, "rollout")) == ("0,1,2,3", "2,3,0,1")


def test_shared_gpu_syncs_over_gloo_and_is_refused_by_submit(tmp_path, monkeypatch) -> None:
    """A one-GPU box: --shared-gpu runs the trainer and the engine on GPU 0 as separate processes. NCCL
    refuses two ranks on one GPU, so the weight-sync group is gloo (docs/gpu.md); submit refuses it."""
    from rlslurm.resolve import resolve
    from rlslurm.settings.weight_plan import weight_sync_plan
    from rlslurm.slurm.render import render
    from tests.helpers.config_errors import one_line_naming
    from tests.helpers.hf_shape import hf_shaped_dir

    (tmp_path / "p.jsonl").write_text(prompt_lines())
    base = ["--model", "tiny-qwen3", "--prompt-data", str(tmp_path / "p.jsonl"), "--device", "cuda",
            "--nodes", "2", "--gpus-per-node", "1", "--trainer-procs-per-node", "1",
            "--hf-checkpoint", str(hf_shaped_dir(tmp_path / "hf", "tiny-qwen3"))]
    shared = base + ["--shared-gpu"]  # no memory share given: the engines size theirs (engines/memory_share.py)
    cfg = resolve(shared, strict_inputs=False).cfg
    assert weight_sync_plan(cfg).backend == "gloo"
    assert weight_sync_plan(resolve(base, strict_inputs=False).cfg).backend is None  # nccl on CUDA
    with pytest.raises(ConfigError, match="--shared-gpu is for `rlslurm run`"):
        render(cfg, tmp_path / "run")
    one_line_naming(shared + ["--weight-sync-backend", "nccl"], "--shared-gpu", "--weight-sync-backend nccl")
    one_line_naming(shared + ["--device", "cpu"], "--shared-gpu", "--device cuda")


def test_engine_gpus_are_named_by_uuid_through_cuda_visible_devices(monkeypatch) -> None:
    """The physical GPU of an engine's device number: its process's CUDA_VISIBLE_DEVICES entry, looked
    up in nvidia-smi's table (faked here: no GPU in CI)."""
    import rlslurm.gpus as gpus

    table = (("0", "GPU-aaa", "00000000:18:00.0"), ("1", "GPU-bbb", "00000000:2A:00.0"),
             ("2", "GPU-ccc", "00000000:3A:00.0"), ("3", "GPU-ddd", "00000000:5D:00.0"))
    monkeypatch.setattr(gpus, "_nvidia_smi", lambda: table)
    assert device_uuids([0, 1], {"CUDA_VISIBLE_DEVICES": "2,3,0,1"}) == ["gpu-ccc", "gpu-ddd"]
    assert device_uuids([0], {"CUDA_VISIBLE_DEVICES": "GPU-bbb,GPU-aaa"}) == ["gpu-bbb"]
    assert device_uuids([1], {}) == ["gpu-bbb"]  # no CUDA_VISIBLE_DEVICES: every GPU, in order
    assert device_uuids([0], {"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "FASTEST_FIRST"}) is None
    assert device_uuids([2], {"CUDA_VISIBLE_DEVICES": "0,1"}) is None
    assert normal_uuid("AAA") == normal_uuid("GPU-aaa") == "gpu-aaa"


def test_a_cpu_run_hides_the_gpus_from_both_groups(tmp_path: Path, monkeypatch) -> None:
    """Fails before: --device cpu handed the roles the machine's GPUs, and on 4 x H100 the CPU trainer put
    megatron's gradient buffers on one beside its gloo group (unsupported device type cuda)."""
    assert _run_split(tmp_path, monkeypatch, "--device", "cpu", "--rollout-dtype", "float32") == ([], [])


def test_device_cuda_takes_the_gpus_the_machine_has(tmp_path: Path, monkeypatch) -> None:
    """`rlslurm run --demo --device cuda` with no --gpus-per-node: the visible GPUs, half to each group
    (all of them, shared, with --colocate); the tiny model's CPU placement (gpus_per_node 0, two trainer
    processes, two CPU engines) does not apply, and the demo's engines serve bfloat16. Before: "--gpus-per-node
    must be >= 1 with --device cuda"."""
    import rlslurm.preflight
    from rlslurm.settings.runfile import load_run_config

    seen = _run(tmp_path / "two", monkeypatch, visible=["0", "1"], dtype=())
    assert seen["gpus"] == (["0", "1"], ["1", "0"])
    cfg = load_run_config(seen["run_dir"])
    assert (cfg.slurm.gpus_per_node, cfg.trainer_procs_per_node, cfg.rollout.rollout_dtype) == (1, 1, "bfloat16")
    monkeypatch.setattr(rlslurm.preflight, "check_colocate", lambda cfg, warnings, strict: None)
    colocated = _run(tmp_path / "one", monkeypatch, "--colocate", visible=["0"], dtype=())
    assert colocated["gpus"] == (["0"], ["0"])
    assert load_run_config(colocated["run_dir"]).slurm.gpus_per_node == 1


def test_one_gpu_for_two_groups_suggests_colocate(tmp_path: Path, monkeypatch) -> None:
    from rlslurm.cli import app

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["run", "--demo", "--run-dir", str(tmp_path / "run"), "--no-progress",
                                      "--device", "cuda"])
    assert isinstance(result.exception, ConfigError), result.output  # the CLI prints a UserError as one line
    assert "1 GPU visible" in str(result.exception) and "--colocate" in str(result.exception)
    assert not (tmp_path / "run" / "run.yaml").exists()
