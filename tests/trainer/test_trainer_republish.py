"""The trainer's side of an engine restarted mid-run (trainer/main.py `_poll`, trainer/weights/delivery.py): the rollout
node keeps such an engine out of the router (`awaiting_weights` in control/engines.json) until it serves the
published version; the trainer, while it waits for a rollout, publishes that version again, once
per restart, and only when its weights are that version. Real run directory and control files;
no model is built (`_poll` is rank 0's decision, made before any collective)."""

from __future__ import annotations

import pytest

from rlslurm.buffer.control import EngineRecord
from rlslurm.trainer.commands import Next
from rlslurm.trainer.weights.delivery import Publish
from tests.trainer.poll_trainer import A, B, engines, trainer


def test_restarted_engine_gets_the_published_version_again_once_per_restart(tmp_path):
    t = trainer(tmp_path)
    engines(t.control)
    assert t._poll(3) == Publish(3, again=True)
    # the supervisor admits it at its next health round; until then it still says awaiting
    assert t._poll(3) is Next.WAIT
    engines(t.control, b_restarts=2)  # restarted again before being admitted: one more publish
    assert t._poll(3) == Publish(3, again=True)
    engines(t.control, b_restarts=2, b_awaiting=False)
    assert t._poll(3) is Next.WAIT


@pytest.mark.parametrize("case", ["not healthy yet", "weights ahead of the published version",
                                  "nothing published in this attempt", "disk mode", "nobody awaits"])
def test_no_repeated_publish(tmp_path, case):
    t = trainer(tmp_path, **{"weights ahead of the published version": dict(published=2),  # interval > 1
                             "nothing published in this attempt": dict(published=None),
                             "disk mode": dict(weight_sync="disk")}.get(case, {}))
    engines(t.control, b_healthy=case != "not healthy yet", b_awaiting=case != "nobody awaits")
    assert t._poll(3) is Next.WAIT


def test_a_deferred_publish_comes_first(tmp_path):
    """After a resume the deferred version goes to every engine anyway: no second publish for it."""
    t = trainer(tmp_path, published=None)
    t.delivery.pending = 3
    engines(t.control)
    assert t._poll(3) == Publish(3)


def test_a_deferred_publish_reaches_a_restarted_engine_once(tmp_path):
    """A version deferred (it reached no engine, or a resume) goes to every healthy engine, the restarted
    one awaiting weights too: not a second time as that engine's republish while its record still says
    awaiting (seen on a GPU: v2 copied twice to a restarted colocated engine)."""
    t = trainer(tmp_path, published=2)
    t.delivery.pending = 3
    engines(t.control)  # B restarted, awaiting weights
    assert t._poll(3) == Publish(3)
    t.delivery.delivered(3)  # what the publish records once it went out
    assert t._poll(3) is Next.WAIT  # B's record says awaiting until its supervisor admits it
    engines(t.control, b_restarts=2)  # restarted again since: that one gets it again
    assert t._poll(3) == Publish(3, again=True)


def test_deferred_publish_waits_for_an_engine_even_past_the_sync_timeout(tmp_path):
    """A resumed trainer whose engines start slower than --weight-sync-timeout-s must not publish to
    nobody: engines that come up afterwards would serve the HF weights, the driver would wait for the
    deferred version and the trainer for the driver's rollout (a deadlock seen by bench/bench_chaos.py)."""
    t = trainer(tmp_path, published=None)
    t.delivery.engines_up = False
    t.delivery.started -= t.cfg.train.weight_sync_timeout_s + 1  # the wait has outlasted the timeout
    t.delivery.pending = 3
    assert t._poll(3) is Next.WAIT  # engines.json lists none yet
    t.control.write_engines([EngineRecord(url=A, node="n0", healthy=False)])
    assert t._poll(3) is Next.WAIT  # registered, still starting
    t.control.write_engines([EngineRecord(url=A, node="n0", healthy=True),
                             EngineRecord(url=B, node="n0", healthy=False)])
    assert t._poll(3) == Publish(3)  # past the timeout, the healthy ones get it; B is the publisher's business


def test_stop_and_preempt_still_win(tmp_path):
    t = trainer(tmp_path)
    engines(t.control)
    t.control.request_stop("test")
    assert t._poll(3) is Next.STOP


def test_a_version_that_reached_no_engine_waits_for_them_and_is_recorded(tmp_path):
    """Issue 30: the disk fallback 'done, loaded by []' reported a version nobody had. A publish that
    reached no engine (all restarting) is pending again until every engine is up, and the metrics say
    what happened to each publish."""
    from rlslurm.trainer.weights.record import Delivered

    t = trainer(tmp_path, published=2)
    t.delivery.record(Delivered(3, "nccl", tries=1, engines=0, errors=("joining engines: no healthy engine",)))
    t.delivery.undelivered(3)
    engines(t.control, b_healthy=False)
    assert t._poll(3) is Next.WAIT  # B still restarting: not yet, whatever the sync timeout
    engines(t.control, b_awaiting=False)
    assert t._poll(3) == Publish(3)
    t.delivery.record(Delivered(3, "nccl", tries=1, engines=2))
    t.delivery.delivered(3)
    m = t.delivery.metrics()
    assert [(d["version"], d["engines"]) for d in m["weight_sync/deliveries"]] == [(3, 0), (3, 2)]
    assert (m["weight_sync/transport"], m["weight_sync/fallbacks"]) == ("nccl", 0)
    assert "weight_sync/deliveries" not in t.delivery.metrics()  # each publish on one line only
