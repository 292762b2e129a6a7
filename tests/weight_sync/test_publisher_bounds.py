"""The broadcast publisher's failure path (trainer/weights/tries.py, broadcast.py) without a live engine (no SGLang
needed): a sync that cannot reach its engines fails every try within its bound, cleans up after itself, and with no
fallback raises `WeightSyncError`, a failure (the attempt is requeued), not a user error. What no
retry heals is refused at once: a weight-sync group NCCL would refuse (two members on one GPU). A
job that ends while a sync waits gives the sync up at once (`SyncInterrupted`)."""

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
from rlslurm.errors import ConfigError, UserError
from rlslurm.net import free_port
from rlslurm.trainer.weights import broadcast
from rlslurm.trainer.weights.base import (
    Roles,
    SyncInterrupted,
    SyncOptions,
    WeightSyncError,
    WeightSyncSetupError,
    setup_refusal,
)
from rlslurm.trainer.weights.broadcast import broadcast_publisher
from rlslurm.trainer.weights.tries import SyncPublisher


def _publisher(control: Control, opts: SyncOptions, *, device: str = "cpu", ending=None) -> SyncPublisher:
    exported = []

    def export(mc, model, dtype):
        exported.append(True)
        yield "model.norm.weight", torch.ones(4)

    roles = Roles(exporter=True, leader=True, coordinator=True, stage=0, stages=1, device=torch.device(device))
    pub = broadcast_publisher(None, control, api_key=None, opts=opts, fallback=None, attempt=0, host="127.0.0.1",
                              roles=lambda: roles, export=export, ending=ending)
    pub.exported = exported
    return pub


def _hung_engine() -> tuple[socket.socket, str]:
    """A peer that accepts connections and never answers (like a SIGSTOPped server: the kernel still
    completes the handshake into the listen backlog)."""
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)
    return hung, f"http://127.0.0.1:{hung.getsockname()[1]}"


def test_engine_that_never_answers_fails_within_bound_and_raises(tmp_path, monkeypatch):
    cleanup_s = 1.0  # the cleanup calls' own bound (10 s in production), short to keep the test short
    monkeypatch.setattr(fanout, "CLEANUP_TIMEOUT_S", cleanup_s)
    control = Control(RunDir.create(tmp_path / "run"))
    hung, url = _hung_engine()
    control.write_engines([EngineRecord(url=url, node="n0", healthy=True)])
    opts = SyncOptions(timeout_s=2.0, attempts=2)
    pub = _publisher(control, opts)
    t0 = time.monotonic()
    try:
        with pytest.raises(WeightSyncError, match=r"version 7 failed 2 time\(s\).*joining engines.*requeued") as e:
            pub.publish(torch.nn.Linear(2, 2), 7)
    finally:
        pub.close()
        hung.close()
    assert not isinstance(e.value, UserError)  # a failed attempt, requeued within --max-failures; not final
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
    nothing listens is left out instead of holding the group's join for its whole timeout. With no
    engine left the version is not delivered (engines=0): no retry, no fallback, no failure; the
    trainer publishes it once the engines are up again (trainer/weights/delivery.py)."""
    control = Control(RunDir.create(tmp_path / "run"))
    dead = f"http://127.0.0.1:{free_port()}"  # a stale record: nothing listens there
    control.write_engines([EngineRecord(url=dead, node="n0", healthy=True)])
    opts = SyncOptions(timeout_s=30.0, attempts=2)
    pub = _publisher(control, opts)
    t0 = time.monotonic()
    try:
        d = pub.publish(torch.nn.Linear(2, 2), 7)
    finally:
        pub.close()
    assert (d.version, d.engines, d.fallback, d.tries) == (7, 0, False, 1) and d.reached_none, d
    assert "1 refused connections" in d.errors[0], d
    assert time.monotonic() - t0 < 10, "a refused engine must not cost the join timeout"
    assert control.rendezvous(0) is None and pub.exported == []
    assert not (control.dir / "weight_update.json").exists() and control.weight_version() is None


def test_no_healthy_engine_is_not_a_failed_sync(tmp_path):
    control = Control(RunDir.create(tmp_path / "run"))
    control.write_engines([EngineRecord(url="http://127.0.0.1:9", node="n0", healthy=False)])
    pub = _publisher(control, SyncOptions(timeout_s=1.0, attempts=1))
    try:
        d = pub.publish(torch.nn.Linear(2, 2), 1)
    finally:
        pub.close()
    assert d.reached_none and "lists no healthy engine" in d.errors[0], d


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


def test_a_group_nccl_would_refuse_is_a_user_error_before_any_engine_is_asked(tmp_path, monkeypatch):
    """Issue 30: the trainer and a TP2 engine's rank 0 on one GPU. NCCL refuses such a group ("Duplicate
    GPU detected") and the engine's ranks stayed wedged in it while the trainer waited 300 s, then fell back
    to disk. The check compares the GPUs' UUIDs first: one line naming each member's GPU, no join asked."""
    monkeypatch.setattr(broadcast, "torch_device_uuid", lambda index: "gpu-aaa")  # the trainer's cuda:0
    control = Control(RunDir.create(tmp_path / "run"))
    hung, url = _hung_engine()  # accepts connections: a join request would hold the publish for its timeout
    control.write_engines([EngineRecord(url=url, node="n0", healthy=True, gpu_ids=[0, 1], ranks=2,
                                        gpu_uuids=["gpu-aaa", "gpu-bbb"])])
    pub = _publisher(control, SyncOptions(timeout_s=30.0, attempts=2, backend="nccl"), device="cuda")
    t0 = time.monotonic()
    try:
        with pytest.raises(WeightSyncSetupError) as e:
            pub.publish(torch.nn.Linear(2, 2), 1)
    finally:
        pub.close()
        hung.close()
    msg = str(e.value)
    assert "\n" not in msg and f"engine {url} TP rank 0" in msg and "both on gpu-aaa" in msg, msg
    assert f"{url}: gpu-aaa, gpu-bbb" in msg and "trainer (stage 0 leader): gpu-aaa" in msg, msg
    assert isinstance(e.value, UserError)  # final: no retry, fallback or requeue heals it
    assert time.monotonic() - t0 < 10 and control.rendezvous(0) is None and pub.exported == []
    assert not (control.dir / "weight_update.json").exists() and control.weight_version() is None

    # GPUs of their own: no clash
    assert broadcast.gpu_clashes(("trainer", "gpu-ccc"), engine_targets(control.engines())) == []


def test_nccl_invalid_usage_in_a_try_is_named_as_a_refused_group():
    """What NCCL says when it refuses a group (torch's DistBackendError text) ends the sync, not a retry."""
    nccl = ("sending stage 0: NCCL error in: ProcessGroupNCCL.cpp:3523, invalid usage (run with NCCL_DEBUG=WARN "
            "for details), NCCL version 2.28.9 ncclInvalidUsage: This usually reflects invalid usage of NCCL "
            "library. Last error: Duplicate GPU detected : rank 0 and rank 1 both on CUDA device 60")
    assert setup_refusal(["joining engines: timed out", nccl]) == nccl
    assert setup_refusal(["joining engines: engines did not join within 300 s"]) is None


def test_a_job_that_ends_gives_up_the_sync_in_flight(tmp_path):
    """Issue 30: Ctrl-C 3 s into a sync whose engines hung was answered "up to 300 s" and the attempt ran on
    for 5 minutes. The waits look at `ending` (a stop, preempt or TERM): the sync is given up within seconds."""
    control = Control(RunDir.create(tmp_path / "run"))
    hung, url = _hung_engine()
    control.write_engines([EngineRecord(url=url, node="n0", healthy=True)])
    t0 = time.monotonic()
    pub = _publisher(control, SyncOptions(timeout_s=120.0, attempts=2), ending=lambda: time.monotonic() - t0 > 1.0)
    try:
        with pytest.raises(SyncInterrupted, match="v3: given up, the job is ending"):
            pub.publish(torch.nn.Linear(2, 2), 3)
    finally:
        pub.close()
        hung.close()
    assert time.monotonic() - t0 < 15, "the stop waited for the sync's timeout"
    assert not (control.dir / "weight_update.json").exists()  # the rollout side is not left paused
    assert control.weight_version() is None
