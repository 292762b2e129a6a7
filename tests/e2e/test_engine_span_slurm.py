"""One SGLang engine over two nodes inside a real SLURM job (issue 17 item 1, engines/span.py), the
trainer colocated with it (`--colocate --nodes 2 --rollout-num-gpus-per-engine 2` on the CPU stack):
an engine of 2 TP ranks runs one rank on each node (SGLang's `--nnodes 2 --node-rank 0|1`, gloo
between them; docs/sglang-behaviour.md), a trainer rank beside each, and the weights go in place
(the IPC transport, memfds on CPU): each TP rank reads the trainer rank of its own node.

Checked in one run:
- the engine is registered once (control/engines.json and the router list one worker, 2 ranks, and
  the node of each rank);
- every weight sync reaches both ranks, each from its own node's trainer rank: both ranks log the
  bucket read in place, and the probe finds the engine at the trainer's version with the trainer's
  greedy tokens (a rank that missed the sync would still hold the checkpoint's half of every
  sharded weight);
- kill -9 of node rank 1's process (the other node's, serving no HTTP at all) restarts the whole
  engine: a new generation, rank 0 restarted by its supervisor and counted, rank 1 started again
  by its node, both meeting at the new address; the syncs after it reach the engine again.
The run is ended by `rlslurm stop` once two syncs after the restart matched (NUM_ROLLOUT is a
ceiling), and ends COMPLETED with every rollout trained once, in order. The broadcast to a spanning
engine (the het layout) runs on GPUs in tests/gpu/test_engine_span.py, and its group is the one
every multi-rank engine joins (tests/weight_sync).
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from rlslurm.buffer.control import Control
from rlslurm.buffer.rundir import RunDir
from rlslurm.demo_task import make_prompts
from rlslurm.rollout.node import RemoteRouter
from tests.e2e.helpers import probes
from tests.e2e.stopped_runs import at_next_commit, check_no_stale_samples, last_probe, stop_and_check, submit, wait_for
from tests.helpers.deliveries import assert_delivered_by
from tests.helpers.process_groups import pid_alive

pytestmark = [pytest.mark.slurm, pytest.mark.sglang, pytest.mark.megatron, pytest.mark.slow]

ENGINE = "engine-0-0"


def matched(run_dir: Path, version: int):
    recs = [r for r in probes(run_dir) if r["version"] >= version and r["match"] and len(r["engines"]) == 1]
    return recs[0] if recs else None


def test_engine_spanning_two_nodes_syncs_every_rank_and_restarts_as_one(slurm_cluster, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job = submit(run_dir, make_prompts(tmp_path / "prompts.jsonl", n=64), "--colocate", "--trainer-procs-per-node", "1",
                 "--engines-per-node", "1", "--rollout-num-gpus-per-engine", "2")
    control = Control(RunDir(run_dir))
    wait_for(lambda: matched(run_dir, 1), 600, "a first sync reaching the engine", run_dir, job)

    engines = control.engines()
    assert [(e.ranks, e.restarts, e.healthy) for e in engines] == [(2, 0, True)], engines
    url = engines[0].url
    router = RemoteRouter.at(control.router().url, api_key=RunDir(run_dir).api_key(), log_path=tmp_path / "r.log")
    assert [w["url"] for w in router.workers()] == [url]  # node rank 1 serves no API: never registered
    span, rank1 = control.span(ENGINE), control.span_rank(ENGINE, 1)
    assert (span.generation, span.nnodes, rank1.generation, rank1.exit_code) == (1, 2, 1, None)
    assert rank1.node != engines[0].node and pid_alive(rank1.pid)
    assert engines[0].nodes == [engines[0].node, rank1.node]  # where --colocate's IPC finds each rank's trainer
    logs = run_dir / "logs/attempt-0"
    trainer_log = (logs / "trainer-0.log").read_text(errors="replace")
    assert "copied in place to 1 engine(s)" in trainer_log and " broadcast to " not in trainer_log, trainer_log[-3000:]
    # each TP rank read its bucket from its own node's trainer rank
    for log in (logs / f"{ENGINE}.log", logs / f"{ENGINE}-rank1.log"):
        assert "read in place" in log.read_text(errors="replace"), log

    # kill -9 of the rank on the other node, between two syncs
    at_next_commit(run_dir, job)
    os.kill(rank1.pid, signal.SIGKILL)

    def restarted():
        rec = next(iter(control.engines()), None)
        s, r = control.span(ENGINE), control.span_rank(ENGINE, 1)
        # a failed restart try takes a generation too: any later one will do, once both ranks run it
        if rec and rec.restarts >= 1 and rec.healthy and s.generation >= 2 and r.generation == s.generation \
                and r.exit_code is None:
            return rec, r
        return None

    rec, rank1_again = wait_for(restarted, 400, "the engine restarted as one (a new generation)", run_dir, job)
    assert rec.url == url and rank1_again.pid != rank1.pid and pid_alive(rank1_again.pid)
    assert not pid_alive(rank1.pid)
    back = last_probe(run_dir)
    wait_for(lambda: matched(run_dir, back + 2), 300, "two syncs reaching the restarted engine", run_dir, job)
    # Either side may tell rank 0's supervisor first: rank 1's node records its exit (within a poll),
    # or rank 0 itself dies of it (SGLang ends a server whose peer went, measured ~6 s later).
    rollout_log = (run_dir / "logs/attempt-0/rollout-0.log").read_text(errors="replace")
    assert re.search(r"engine-0-0 \(\S+\): exited(: node rank 1 on \S+)? \(code -9\); restarting", rollout_log), \
        rollout_log[-3000:]
    follower_log = (run_dir / "logs/attempt-0/rollout-1.log").read_text(errors="replace")
    assert "engine-0-0 node rank 1 exited (code -9) in generation 1" in follower_log, follower_log[-3000:]

    ids, before_stop = stop_and_check(slurm_cluster, run_dir, job)
    check_no_stale_samples(run_dir)
    recs = [r for r in probes(run_dir) if r["version"] <= before_stop]
    # every probe that reached the engine found it at the trainer's version with the same greedy tokens
    assert recs and all(r["match"] for r in recs if url in r["engines"] and "error" not in r["engines"][url]), recs
    assert len(ids) >= back + 2
    # in place from the trainer ranks' memfd buffers (CUDA IPC's CPU twin) on each rank's own node
    assert_delivered_by(run_dir, "memfd", versions=set(range(1, before_stop + 1)))
