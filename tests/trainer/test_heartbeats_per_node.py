"""Trainer heartbeats are per node, not per rank (issue 31 item 8, docs/shared-fs-load.md): two gloo
ranks under torchrun on one node train two rollouts, and only rank 0 (the node's local rank 0) ever
writes control/heartbeats/. Every heartbeat is an fsynced temp file and a rename on the shared run
directory: per rank, a 1,024-GPU job would pay 1,024 of them every 10 s."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import commit_rollouts, make_run, metrics, run_trainer

pytestmark = [pytest.mark.megatron, pytest.mark.slow]


def test_one_heartbeat_per_trainer_node(tmp_path: Path, tiny_hf: Path) -> None:
    run = make_run(tmp_path / "run", tiny_hf, nproc=2, rollout=dict(num_rollout=2))
    commit_rollouts(run, range(2))
    run_trainer(run, nproc=2)
    assert [m["rollout_id"] for m in metrics(run)][-1] == 1  # both rollouts trained, by both ranks
    beats = sorted(p.name for p in (run / "control" / "heartbeats").iterdir())
    # no trainer-1.json, not even a temp file of one: rank 1 never wrote a heartbeat
    assert beats == ["trainer-0.json"], beats
