"""How much host memory a node's trainer may page-lock (docs/checkpoints.md, "The staging area"; docs/colocate.md).

Two things page-lock host memory for the whole run, per trainer rank: the asynchronous checkpoint's
staging area (trainer/checkpoint/staging.py: this rank's share of a checkpoint, weights + fp32 main params
+ Adam's moments) and, under --colocate, the host copies of what of the trainer's state moves between turns
(trainer/tensor_sets.py). Page-locked memory cannot be swapped or reclaimed: more of it than the node (or
the job's cgroup) has left makes the kernel's OOM killer end a process of the job, or the registration
fail, mid-run. So before reserving any, the trainer compares what its node's ranks would lock with what is
available (MemAvailable, and the cgroup's limit less its usage): first the staging area (`may_page_lock`),
then, once it knows what moves (trainer/offload_choice.py), the copies beside it (`copies_pin_budget`: as
many of them as fit are page-locked). Past HEADROOM of it, that memory stays pageable (the same copies, at
pageable speed), said in one line. `rlslurm submit` makes the same estimate against --mem where it is
given, counting the copies whole (what moves is not known there).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

log = logging.getLogger(__name__)

# The share of the available memory the trainer may page-lock: the rest is the processes' own (the
# writer's fork, the data, the engines beside a colocated trainer).
HEADROOM = 0.8
_UNLIMITED = 1 << 62


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return _UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _cgroup_room(proc_cgroup: Path, cgroup_root: Path) -> int | None:
    """The memory this process's cgroup (v2, or v1's memory controller) has left: limit - usage."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hid, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        rel = path.lstrip("/")
        if hid == "0" and controllers == "":  # v2: the unified hierarchy
            d = cgroup_root / rel
            limit, usage = _read_int(d / "memory.max"), _read_int(d / "memory.current")
        elif "memory" in controllers.split(","):  # v1
            d = cgroup_root / "memory" / rel
            limit, usage = _read_int(d / "memory.limit_in_bytes"), _read_int(d / "memory.usage_in_bytes")
        else:
            continue
        if limit is not None and usage is not None and limit < _UNLIMITED // 2:
            return max(0, limit - usage)
    return None


def available(meminfo: Path = Path("/proc/meminfo"), proc_cgroup: Path = Path("/proc/self/cgroup"),
              cgroup_root: Path = Path("/sys/fs/cgroup")) -> tuple[int | None, str]:
    """(bytes this node's processes can still take, where that figure comes from); None if unknown."""
    free = None
    try:
        m = re.search(r"^MemAvailable:\s+(\d+) kB", meminfo.read_text(), re.MULTILINE)
        free = int(m.group(1)) * 1024 if m else None
    except OSError:
        pass
    room = _cgroup_room(proc_cgroup, cgroup_root)
    if room is not None and (free is None or room < free):
        return room, "the job's cgroup limit less its usage"
    return free, "MemAvailable"


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def may_page_lock(per_rank: int, local_ranks: int, colocate_offload: bool,
                  room: tuple[int | None, str] | None = None) -> tuple[bool, str | None]:
    """Whether this node's trainer ranks may page-lock their staging areas (and --colocate's host
    copies): (yes or no, the one line that says why not)."""
    room = available() if room is None else room
    have, source = room
    what = "asynchronous checkpoint staging" + (" and --colocate's offload copies" if colocate_offload else "")
    need = per_rank * local_ranks * (2 if colocate_offload else 1)
    if have is None or need <= HEADROOM * have:
        return True, None
    line = (f"HOST MEMORY: this node's {local_ranks} trainer rank(s) would page-lock {gib(need)} ({what}), "
            f"more than {HEADROOM:.0%} of the {gib(have)} available ({source}); that memory stays pageable "
            f"(the same copies, slower)")
    if need > have:
        line += ("; even so it does not fit, and the first save may be killed for memory: give the job "
                 "more memory (--mem) or more trainer nodes")
    return False, line


def copies_pin_budget(copies: int, locked: int, local_ranks: int, room: tuple[int | None, str] | None = None
                      ) -> tuple[int | None, str | None]:
    """--colocate's host copies, once the trainer knows what moves (trainer/turns.py): the bytes of them each
    rank may page-lock beside the `locked` bytes it page-locks already (its checkpoint staging area), within
    HEADROOM of `room` (measured before the staging area was reserved: trainer/main.py), and the one line
    that says what stays pageable; None: every copy (room unknown, or everything fits). `copies`: this
    rank's bytes that move at the decision; more that a re-check moves later is pinned while the budget
    lasts (tensor_sets.PinBudget), then pageable."""
    room = available() if room is None else room
    have, source = room
    if have is None or (locked + copies) * local_ranks <= HEADROOM * have:
        return None, None
    budget = max(0, int(HEADROOM * have / local_ranks) - locked)
    return budget, (f"HOST MEMORY: this node's {local_ranks} trainer rank(s) would page-lock "
                    f"{gib((locked + copies) * local_ranks)} (checkpoint staging and --colocate's offload copies), "
                    f"more than {HEADROOM:.0%} of the {gib(have)} available ({source}): {gib(budget)} of each "
                    f"rank's {gib(copies)} of offload copies are page-locked, the rest stays pageable (slower "
                    f"copies, not overlapped)")


def parse_mem(text: str) -> int | None:
    """sbatch --mem (`500G`, `64000` MB by default) in bytes; None for 0 (all of the node's) or unknown."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*", text.upper())
    if not m:
        return None
    n = float(m.group(1)) * 1024 ** " KMGT".index(m.group(2) or "M")
    return int(n) or None


def submit_line(cfg, mc) -> str | None:
    """The same estimate at submit against --mem (the node's memory is known there only from it)."""
    s, t = cfg.slurm, cfg.train
    mem = parse_mem(s.mem) if s.mem else None
    if mem is None or cfg.run.device != "cuda":
        return None
    params = mc.num_params / (t.tensor_model_parallel_size * t.pipeline_model_parallel_size)
    world = (s.trainer_nodes or 1) * cfg.trainer_procs_per_node
    dp = max(1, world // (t.tensor_model_parallel_size * t.pipeline_model_parallel_size *
                          t.context_parallel_size))
    per_rank = params * (2 if t.bf16 else 4) + 12 * params / (dp if t.use_distributed_optimizer else 1)
    ok, line = may_page_lock(int(per_rank), cfg.trainer_procs_per_node,
                             cfg.run.colocate and cfg.run.offload_train is not False, (mem, f"--mem {s.mem}"))
    return None if ok else f"--mem {s.mem}: " + line.removeprefix("HOST MEMORY: ").replace("would page-lock",
                                                                                           "would page-lock about", 1)


def local_ranks() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
