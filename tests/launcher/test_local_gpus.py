"""`rlslurm run --device cuda` on one machine gives each group its own GPUs (trainer first), as the het
job gives each its own nodes; too few GPUs is a one-line error before anything starts."""

from __future__ import annotations

import pytest

from rlslurm.errors import ConfigError
from rlslurm.local import split_gpus, visible_gpus


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
