"""Page-locked host memory against the node's (rlslurm/trainer/host_memory.py): the checkpoint staging
area and --colocate's offload copies are page-locked for the whole run, per rank; more than the node or
the job's cgroup has left stays pageable, said in one line, at submit (against --mem) and in the
trainer (against MemAvailable and the cgroup's limit)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlslurm.resolve import resolve
from rlslurm.trainer import host_memory
from rlslurm.trainer.checkpoint.staging import StagingArea

GIB = 2**30


def _meminfo(tmp_path: Path, avail_gib: float) -> Path:
    p = tmp_path / "meminfo"
    p.write_text(f"MemTotal:       999999999 kB\nMemFree:  1 kB\nMemAvailable:   {int(avail_gib * 2**20)} kB\n")
    return p


def test_available_is_the_smaller_of_meminfo_and_the_cgroup(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    (root / "slurm" / "job_7").mkdir(parents=True)
    (root / "slurm" / "job_7" / "memory.max").write_text(f"{40 * GIB}\n")
    (root / "slurm" / "job_7" / "memory.current").write_text(f"{10 * GIB}\n")
    v2 = tmp_path / "cgroup-v2"
    v2.write_text("0::/slurm/job_7\n")
    assert host_memory.available(_meminfo(tmp_path, 100), v2, root) == (30 * GIB,
                                                                        "the job's cgroup limit less its usage")
    (root / "slurm" / "job_7" / "memory.max").write_text("max\n")
    assert host_memory.available(_meminfo(tmp_path, 100), v2, root) == (100 * GIB, "MemAvailable")
    (root / "memory" / "job_8").mkdir(parents=True)  # cgroup v1's memory controller
    (root / "memory" / "job_8" / "memory.limit_in_bytes").write_text(f"{16 * GIB}")
    (root / "memory" / "job_8" / "memory.usage_in_bytes").write_text(f"{4 * GIB}")
    v1 = tmp_path / "cgroup-v1"
    v1.write_text("12:cpu,cpuacct:/job_8\n7:memory:/job_8\n")
    assert host_memory.available(_meminfo(tmp_path, 100), v1, root)[0] == 12 * GIB
    assert host_memory.available(tmp_path / "none", tmp_path / "none", root) == (None, "MemAvailable")


def test_past_the_headroom_the_memory_stays_pageable_with_one_line() -> None:
    assert host_memory.may_page_lock(10 * GIB, 4, False, (100 * GIB, "MemAvailable")) == (True, None)
    ok, line = host_memory.may_page_lock(11 * GIB, 4, True, (100 * GIB, "MemAvailable"))
    assert not ok and "\n" not in line
    assert line.startswith("HOST MEMORY: this node's 4 trainer rank(s) would page-lock 88.0 GiB (asynchronous "
                           "checkpoint staging and --colocate's offload copies), more than 80% of the 100.0 GiB")
    assert "stays pageable" in line and "does not fit" not in line
    ok, line = host_memory.may_page_lock(40 * GIB, 4, False, (100 * GIB, "the job's cgroup limit less its usage"))
    assert not ok and "even so it does not fit" in line and "cgroup" in line
    assert host_memory.may_page_lock(10**15, 8, True, (None, "MemAvailable"))[0]  # unknown: as before


def test_a_staging_area_that_may_not_page_lock_stays_pageable() -> None:
    """On a node short of host memory the area is made pageable even where the tensors are on a GPU (on
    this CPU machine a cudaHostRegister would raise: the refusal is what the test sees)."""
    area = StagingArea()
    area.allow_pin = False
    try:
        area._ensure(4096, pin=True)
        assert area.staging == "pageable" and not area._registered and area.size >= 4096
    finally:
        area.close()


@pytest.mark.parametrize("mem,warned", [("64G", True), ("2000G", False), ("0", False)])
def test_submit_says_it_where_mem_tells_the_nodes_memory(tmp_path: Path, mem: str, warned: bool) -> None:
    gpu = ["--model", "qwen3-8B", "--nodes", "2", "--gpus-per-node", "8", "--device", "cuda", "--mem", mem]
    res = resolve(gpu, strict_inputs=False)
    lines = [w for w in res.warnings if "page-lock" in w]
    assert bool(lines) == warned, res.warnings
    if warned:
        assert lines[0].startswith(f"--mem {mem}: this node's 8 trainer rank(s) would page-lock about ")
    assert host_memory.parse_mem("500G") == 500 * GIB and host_memory.parse_mem("64000") == 64000 * 2**20


def test_the_colocated_copies_page_lock_what_fits_beside_the_staging_area() -> None:
    """Once the trainer knows what moves (trainer/turns.py), its host copies are checked beside the staging
    area it page-locked, against the room measured at the start: all of them where they fit; else as many
    bytes as fit, the rest pageable, said in one line. The GPU machine's case (bench/results/
    gpu-lease-2026-12-07d.md): qwen3-4B, 121.6 GiB available, a 53 GiB staging area and 19.5 GiB of
    optimizer state that moves fit (72.5 <= 97.3 GiB); counted whole (every set, 105 GiB) they did not,
    and both stayed pageable."""
    room = (int(121.6 * GIB), "MemAvailable")
    assert host_memory.copies_pin_budget(int(19.5 * GIB), 53 * GIB, 1, room) == (None, None)
    assert not host_memory.may_page_lock(53 * GIB, 1, True, room)[0]  # the old count: staging x 2
    budget, line = host_memory.copies_pin_budget(60 * GIB, 53 * GIB, 1, room)
    assert budget == int(0.8 * room[0]) - 53 * GIB and "\n" not in line
    assert line.startswith("HOST MEMORY: this node's 1 trainer rank(s) would page-lock 113.0 GiB (checkpoint "
                           "staging and --colocate's offload copies), more than 80% of the 121.6 GiB available")
    assert f"{budget / GIB:.1f} GiB of each rank's 60.0 GiB of offload copies are page-locked" in line
    assert host_memory.copies_pin_budget(10**15, 0, 8, (None, "MemAvailable")) == (None, None)  # unknown
    assert host_memory.copies_pin_budget(60 * GIB, 100 * GIB, 1, room)[0] == 0  # the staging area took it all


def test_a_pin_budget_is_shared_and_a_copy_past_it_stays_pageable() -> None:
    from rlslurm.trainer.tensor_sets import PinBudget

    unlimited = PinBudget()
    assert unlimited.take(10**15) and unlimited.remaining is None
    b = PinBudget(100)
    assert b.take(60) and not b.take(50) and b.take(40) and b.remaining == 0 and not b.take(1)
