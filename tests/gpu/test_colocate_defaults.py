"""The colocated demo with the defaults on one GPU, as a user runs it: `rlslurm run --demo --colocate
--device cuda`, no memory share given. Before: on an H200 the engine took SGLang's default 0.907 of the
GPU beside the trainer and died of CUDA OOM at every resume after the trainer's turn, restarted in a
loop (3 rollouts in 5 minutes). Now: the engines start once the trainer has left the GPU and take a
share rlslurm derives (rlslurm/engines/memory_share.py); an engine kill -9 mid-run is restarted once
and brought up to date; every version goes by CUDA IPC; no engine dies of OOM."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from rlslurm.buffer.control import Control
from rlslurm.buffer.rundir import RunDir
from tests.gpu.colocated_runs import OOM, colocated, engine_text, gpu_name, restart_causes, shares
from tests.gpu.run_checks import finish, logs, metrics
from tests.helpers.deliveries import assert_delivered_by, final_lineage

N = 20


def test_colocated_demo_with_defaults_survives_an_engine_kill(tmp_path: Path) -> None:
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    proc = colocated(run_dir, log, "--demo", "--num-rollout", str(N))
    deadline = time.monotonic() + 420
    while len({m["rollout_id"] for m in metrics(run_dir)}) < 5:
        assert proc.poll() is None, f"ended early (rc={proc.returncode})\n{logs(run_dir, log)}"
        assert time.monotonic() < deadline, logs(run_dir, log)
        time.sleep(0.5)
    [engine] = Control(RunDir(run_dir)).engines()
    os.killpg(engine.pid, signal.SIGKILL)  # the whole server: its HTTP process, scheduler and detokenizer
    assert finish(proc, run_dir, log, 600) == 0, logs(run_dir, log)

    assert final_lineage(run_dir) == list(range(N)) and {m["attempt"] for m in metrics(run_dir)} == {0}
    assert_delivered_by(run_dir, "cuda-ipc")  # every version, the one again after the restart included
    causes = restart_causes(run_dir)
    assert len(causes) == 1 and "exited (code -9)" in causes[0], causes
    assert not OOM.search(engine_text(run_dir)), logs(run_dir, log)
    starts = shares(run_dir)
    assert len(starts) == 2 and all(s["derived"] and s["fraction"] < s["sglang_default"] for s in starts), starts
    [rec] = Control(RunDir(run_dir)).engines()
    assert rec.restarts == 1 and rec.healthy
    s = starts[0]
    print(f"GPU colocated demo, defaults ({gpu_name()}): {N}/{N} rollouts in one attempt, every version by "
          f"cuda-ipc; engine restarts: {causes}; share {s['fraction']:.3f} derived (SGLang's default "
          f"{s['sglang_default']}, {s['free_gib']:.1f} of {s['total_gib']:.1f} GiB free at the engine's start, "
          f"SGLang's reserve {s['sglang_reserve_gib']:.1f} GiB, the trainer's margin {s['margin_gib']:.2f} GiB); "
          f"after the restart {starts[1]['fraction']:.3f}")
