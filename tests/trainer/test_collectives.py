"""The trainer's collectives: control tensors on the group's device, explicit timeouts that outlast
rank 0's lone phases (trainer/collectives.py). The NCCL side of the device rule is exercised by the
GPU tier (tests/gpu: a checkpoint save under NCCL); here the gloo side and the config checks."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from rlslurm.errors import ConfigError
from rlslurm.resolve import min_distributed_timeout_s, resolve
from rlslurm.trainer.collectives import collective_device, group_timeout
from tests.helpers.hf_shape import hf_shaped_dir
from tests.helpers.prompt_files import prompt_lines


@pytest.fixture
def gloo_world(tmp_path: Path):
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1,
                            timeout=group_timeout(2))
    yield
    dist.destroy_process_group()


def test_gloo_collectives_use_cpu_tensors(gloo_world) -> None:
    assert collective_device() == torch.device("cpu")
    t = torch.ones(2, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    assert t.tolist() == [1.0, 1.0]


def test_group_timeout_is_minutes() -> None:
    assert group_timeout(60) == timedelta(hours=1)


def _argv(tmp_path: Path, *extra: str) -> list[str]:
    p = tmp_path / "train.jsonl"
    p.write_text(prompt_lines())
    return ["--model", "qwen3-4B", "--nodes", "2", "--prompt-data", str(p), "--hf-checkpoint",
            str(hf_shaped_dir(tmp_path / "hf", "qwen3-4B")), *extra]


def test_default_timeout_outlasts_a_lone_weight_sync(tmp_path: Path) -> None:
    t = resolve(_argv(tmp_path)).cfg.train
    assert t.distributed_timeout_minutes * 60 >= min_distributed_timeout_s(t.weight_sync_timeout_s)


def test_timeout_shorter_than_weight_sync_bound_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--distributed-timeout-minutes 10 .*--weight-sync-timeout-s 600"):
        resolve(_argv(tmp_path, "--distributed-timeout-minutes", "10", "--weight-sync-timeout-s", "600"))


def _rank0_fails(rank: int, rdzv: str, out: str) -> None:
    import json

    from rlslurm.buffer.atomic import CorruptRecord
    from rlslurm.trainer.collectives import from_rank0

    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=2, timeout=group_timeout(1))
    try:
        assert from_rank0(rank, 2, lambda: {"verdict": rank}) == {"verdict": 0}

        def poll():
            raise CorruptRecord("RUN/control/stop.json: damaged on disk")

        try:
            from_rank0(rank, 2, poll)
            got = None
        except Exception as e:  # noqa: BLE001
            got = [type(e).__name__, str(e)]
        Path(f"{out}.{rank}").write_text(json.dumps(got))
    finally:
        dist.destroy_process_group()


def test_an_error_rank0_meets_ends_every_rank_alike(tmp_path: Path) -> None:
    """Rank 0 alone reads the run directory (trainer/main.py `_poll`): a damaged record it meets used to
    end rank 0 only, the others waiting in the next broadcast until torchrun killed them. Now every
    rank raises the same error (a CorruptRecord: a failed attempt, requeued; not a user error)."""
    import json

    import torch.multiprocessing as mp

    mp.start_processes(_rank0_fails, args=(str(tmp_path / "rdzv"), str(tmp_path / "out")), nprocs=2,
                       start_method="fork", join=True)
    for rank in (0, 1):
        assert json.loads((tmp_path / f"out.{rank}").read_text()) == ["CorruptRecord",
                                                                      "RUN/control/stop.json: damaged on disk"]
