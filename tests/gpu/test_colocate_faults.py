"""--colocate under faults on a GPU (issue 31 item 5): the trainer and one real SGLang engine take turns
on GPU 0; a kill -9 of the engine inside the trainer's turn restarts it only after the turn (inside it
the new engine would take the trainer's memory), and a TERM inside a later turn saves there with the
engine released. The scenario: tests/helpers/colocate_faults.py (the CPU suite runs the same one)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.gpu.bundle_flags import run_flags
from tests.helpers.colocate_faults import kill_then_term_inside_turns


def test_colocated_engine_kill9_and_term_inside_the_turn_on_a_gpu(tmp_path: Path) -> None:
    run = kill_then_term_inside_turns(tmp_path, ["--device", "cuda", "--gpus-per-node", "1",
                                                 "--trainer-procs-per-node", "1", "--rollout-dtype", "bfloat16",
                                                 *run_flags()],
                                      steps=400, engines=1)  # the demo model steps in ~20 ms on a GPU
    # the mechanism on a GPU: trainer and engine on the same one, before and after the restart
    attempt = run / "logs" / "attempt-0"
    trainer = {json.loads(p.read_text())["gpu_uuid"] for p in attempt.glob("env-trainer-*.json")}
    engines = json.loads((run / "control" / "engines.json").read_text())["engines"]
    assert len(trainer) == 1 and all(set(e["gpu_uuids"]) == trainer for e in engines), (trainer, engines)
