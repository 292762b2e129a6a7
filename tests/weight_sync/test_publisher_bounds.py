"""DistributedPublisher's failure path without a live engine (no SGLang needed): a sync that
cannot reach its engines fails every try within its bound, cleans up after itself, and with no
fallback raises `WeightSyncError` so the step fails and the job is requeued."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from rlslurm.buffer.control import Control, EngineRecord
from rlslurm.buffer.rundir import RunDir
from rlslurm.engines import fanout
from rlslurm.engines.fanout import engine_targets
from rlslurm.engines.update_watch import update_in_progress
from rlslurm.errors import ConfigError
from rlslurm.net import free_port
from rlslurm.trainer.weight_sync import DistributedPublisher, SyncOptions, WeightSyncError, _Roles


def _publisher(control: Control, opts: SyncOptions) -> DistributedPublisher:
    exported = []

    def export(mc, model, dtype):
        exported.append(True)
        yield "model.norm.weight", torch.ones(4)

    pub = DistributedPublisher(None, control, api_key=None, opts=opts, fallback=None, attempt=0, host="127.0.0.1",
                               roles=lambda: _Roles(exporter=True, leader=True, coordinator=True, stage=0, stages=1),
                               export=export)
    pub.exported = exported
    return pub


def test_engine_that_never_answers_fails_within_bound_and_raises(tmp_path, monkeypatch):
    cleanup_s = 1.0  # the cleanup calls' own bound (10 s in production), short to keep the test short
    monkeypatch.setattr(fanout, "CLEANUP_TIMEOUT_S", cleanup_s)
    control = Control(RunDir.create(tmp_path / "run"))
    # a peer that accepts connections and never answers (like a SIGSTOPped server: the kernel
    # still completes the handshake into the listen backlog)
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)
    url = f"http://127.0.0.1:{hung.getsockname()[1]}"
    control.write_engines([EngineRecord(url=url, node="n0", healthy=True)])
    opts = SyncOptions(timeout_s=2.0, attempts=2)
    pub = _publisher(control, opts)
    t0 = time.monotonic()
    try:
        with pytest.raises(WeightSyncError, match=r"version 7 failed 2 time\(s\).*joining engines.*requeued"):
            pub.publish(torch.nn.Linear(2, 2), 7)
    finally:
        pub.close()
        hung.close()
    # each try waits for the join timeout (+5 s for the init call's future) and the bounded
    # cleanup (destroy; end/continue on release), never more
    assert time.monotonic() - t0 < opts.attempts * (opts.timeout_s + 5 + cleanup_s + 5) + 2 * cleanup_s + 5
    assert time.monotonic() - t0 >= opts.attempts * opts.timeout_s * 0.9  # it did wait for the join
    assert control.weight_version() is None          # nothing was published
    assert not update_in_progress(control)           # the rollout side is not left paused
    assert not (control.dir / "weight_update.json").exists()
    assert control.rendezvous(0).group_name == "rlslurm-wsync-a0-pp0-b1"  # one record per attempt
    assert pub.exported == []                        # never exported into a group that did not form


def test_engine_that_refuses_connections_is_left_out_at_once(tmp_path):
    """engines.json lags a kill -9 by up to the supervisor's health interval: an engine where
    nothing listens is left out instead of holding the group's join for its whole timeout."""
    control = Control(RunDir.create(tmp_path / "run"))
    dead = f"http://127.0.0.1:{free_port()}"  # a stale record: nothing listens there
    control.write_engines([EngineRecord(url=dead, node="n0", healthy=True)])
    opts = SyncOptions(timeout_s=30.0, attempts=2)
    pub = _publisher(control, opts)
    t0 = time.monotonic()
    try:
        with pytest.raises(WeightSyncError, match=r"joining engines: .*no healthy engine.*1 refused connections"):
            pub.publish(torch.nn.Linear(2, 2), 7)
    finally:
        pub.close()
    assert time.monotonic() - t0 < 10, "a refused engine must not cost the join timeout"
    assert control.rendezvous(0) is None and pub.exported == []
    assert not (control.dir / "weight_update.json").exists()


def test_no_healthy_engine_is_a_failed_sync(tmp_path):
    control = Control(RunDir.create(tmp_path / "run"))
    control.write_engines([EngineRecord(url="http://127.0.0.1:9", node="n0", healthy=False)])
    pub = _publisher(control, SyncOptions(timeout_s=1.0, attempts=1))
    try:
        with pytest.raises(WeightSyncError, match="lists no healthy engine"):
            pub.publish(torch.nn.Linear(2, 2), 1)
    finally:
        pub.close()


def test_engine_targets_ranks_and_health():
    recs = [EngineRecord(url="http://a:1", node="n", gpu_ids=[0, 1], healthy=True, restarts=2, pid=5),
            EngineRecord(url="http://b:1", node="n", healthy=False),
            EngineRecord(url="http://c:1", node="n", healthy=True),
            # spanning two nodes of 2 GPUs (engines/span.py): every TP rank on every node joins the group
            EngineRecord(url="http://d:1", node="n", gpu_ids=[0, 1], ranks=4, nodes=["n", "m"], healthy=True)]
    t = engine_targets(recs)
    assert [(x.url, x.ranks, x.restarts) for x in t] == [("http://a:1", 2, 2), ("http://c:1", 1, 0),
                                                         ("http://d:1", 4, 0)]


@pytest.mark.parametrize("kw, msg", [({"bucket_bytes": 0}, "update_weight_buffer_size"),
                                     ({"timeout_s": 0}, "weight_sync_timeout_s"),
                                     ({"attempts": 0}, "attempts")])
def test_sync_options_reject(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        SyncOptions(**kw)


def test_update_in_progress_expires(tmp_path):
    control = Control(RunDir.create(tmp_path / "run"))
    assert not update_in_progress(control)
    control.mark_weight_update(3, budget_s=60)
    assert update_in_progress(control)
    assert not update_in_progress(control, now=time.time() + 61)  # a crashed trainer's file goes stale
    control.clear_weight_update()
    assert not update_in_progress(control)
