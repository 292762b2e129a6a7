"""Weight-sync faults inside a real heterogeneous SLURM job (issue 6): the GRPO run of
test_grpo_slurm.py (trainer: 2 gloo ranks; rollout: 2 real SGLang servers + sglang-router), with,
one after the other in the same run,

a) kill -9 of one SGLang server between syncs (right after a rollout is committed, so the
   next sync meets the dead engine first): that sync goes over the broadcast group to the
   survivor without waiting for the dead one; the rollout node's supervisor restarts it, the
   restart is counted, it is routed again only once it serves the published version, and the
   syncs after it reach both engines again (the --verify-weight-sync probe: both at the new
   version, greedy output equal to the trainer's);
b) a peer that never answers: the other server's whole process tree SIGSTOPped right after a rollout
   is committed, i.e. just before the trainer's sync of the next version. That sync's first try
   times out within --weight-sync-timeout-s (plus the bounded cleanup); the retry leaves the engine
   that did not answer out and delivers the version over the broadcast group to the other, at once
   (a wedged engine is not waited on again: issue 30); the rollout node holds health checks only
   while a try runs and then restarts the hung server, which re-joins a later sync. No version goes
   through the disk fallback: every one is delivered by gloo (metrics.jsonl's record of each publish).

Throughout, no sample of any rollout comes from weights older than the rollout needs (synchronous
RL: every sample of rollout k has weight_version k), although an engine restarted mid-run holds
the HF checkpoint until a sync reaches it.

How long the runs are: a rollout cycle of tiny-qwen3 takes ~1.5-2 s here, while a restarted
CPU SGLang server needs ~60 s (measured: 59 s on the loaded 2-core box) to be healthy again, and
the run has to outlast the restart for a sync to show the engine back. A fixed --num-rollout
would either waste minutes or end before the re-join on a slower day, so NUM_ROLLOUT is only a
ceiling: once two syncs after the restart have reached both engines, the test ends the run with
`rlslurm stop` (the trainer exits before its next rollout, the batch script exits 0). The job
ends COMPLETED with every rollout the trainer took trained exactly once, in order.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest

from rlslurm.buffer.control import Control
from rlslurm.buffer.rundir import RunDir
from rlslurm.demo_task import make_prompts
from rlslurm.engines.fanout import CLEANUP_TIMEOUT_S
from rlslurm.engines.sglang_client import weight_version_sync
from rlslurm.rollout.node import RemoteRouter
from tests.e2e.helpers import probes
from tests.e2e.stopped_runs import at_next_commit, check_no_stale_samples, last_probe, stop_and_check, submit, wait_for
from tests.helpers.deliveries import assert_delivered_by
from tests.helpers.process_groups import pid_alive

pytestmark = [pytest.mark.slurm, pytest.mark.sglang, pytest.mark.megatron, pytest.mark.slow]

SYNC_TIMEOUT_S = 10.0   # --weight-sync-timeout-s


def synced_both(run_dir: Path, version: int):
    """The probe of `version` (or later) once it lists two engines, all matching."""
    recs = [r for r in probes(run_dir) if r["version"] >= version and len(r["engines"]) == 2 and r["match"]]
    return recs[0] if recs else None


def engine_record(control: Control, url: str):
    return next((e for e in control.engines() if e.url == url), None)


def check_probe_entries(recs: list[dict]) -> None:
    """Every engine a probe reached serves the probed version with the trainer's weights. An engine
    restarted since the sync holds the checkpoint's weights and is not asked (it is not routed
    either); a dead or hung one shows as an error."""
    for r in recs:
        for url, e in r["engines"].items():
            if "error" not in e:
                assert str(e["weight_version"]) == str(r["version"]) and e["same"], (url, r)


def by_version(recs: list[dict], n_trained: int) -> dict[int, dict]:
    """The first probe of each version. A version may be probed twice: the trainer publishes it
    again to an engine that restarted since (kept out of the router until then). The last one may be
    missing: no publish begins once the stop is requested (the checkpoint carries that version)."""
    versions = [r["version"] for r in recs]
    assert versions == sorted(versions) and set(versions) in (set(range(1, n_trained + 1)),
                                                              set(range(1, n_trained))), versions
    first: dict[int, dict] = {}
    for r in recs:
        first.setdefault(r["version"], r)
    return first


def check_rejoined(control: Control, router: RemoteRouter, url: str, run_dir: Path, job: int) -> None:
    """Routed again within a few health rounds of the restart, and only at the published version
    (the record is written after a sync has reached its engines, so a routed engine is never behind it)."""
    def routed():
        rec = engine_record(control, url)
        healthy = {w["url"] for w in router.workers() if w["is_healthy"]}
        return rec is not None and rec.healthy and not rec.awaiting_weights and url in healthy

    wait_for(routed, 120, f"{url} routed again", run_dir, job, poll=0.05)
    published = control.weight_version().version
    have = int(weight_version_sync(url, RunDir(run_dir).api_key(), timeout=60))
    assert have >= published, (url, have, published)


def restarts_in_metrics(run_dir: Path) -> float:
    p = run_dir / "rollout_metrics.jsonl"
    lines = [json.loads(l) for l in p.read_text().splitlines()] if p.exists() else []
    return max((l.get("rollout/engine/restarts_total", 0.0) for l in lines), default=0.0)


_TRY = re.compile(r"weight sync v(\d+): try (\d+)/(\d+) failed after ([\d.]+) s")


def test_kill9_then_hung_engine_between_syncs_restart_rejoin_and_bounded_retry(slurm_cluster, tmp_path: Path) -> None:
    """One run, two faults in turn: a) kill -9 of engine B, then, once B is back and two syncs
    reached both engines, b) engine A hung (SIGSTOP of its process tree)."""
    run_dir = tmp_path / "run"
    job = submit(run_dir, make_prompts(tmp_path / "prompts.jsonl", n=64), "--weight-sync-timeout-s",
                 str(SYNC_TIMEOUT_S))
    control = Control(RunDir(run_dir))
    router = None
    first = wait_for(lambda: synced_both(run_dir, 1), 600, "a first sync reaching both engines", run_dir, job)

    # a) kill -9 of B between syncs
    victim = control.engines()[1]
    survivor = control.engines()[0].url
    assert victim.pid and victim.restarts == 0 and victim.url in first["engines"]
    v_kill = at_next_commit(run_dir, job) + 1  # the sync that meets the dead engine first
    os.kill(victim.pid, signal.SIGKILL)  # the server process itself, as `kill -9 <pid>` would

    def restarted(url: str, old_pid: int):
        rec = engine_record(control, url)
        return rec if rec and rec.restarts == 1 and rec.healthy and rec.pid != old_pid else None

    killed_rec = wait_for(lambda: restarted(victim.url, victim.pid), 400, f"{victim.url} restarted", run_dir, job)
    assert not pid_alive(victim.pid)
    router = RemoteRouter.at(control.router().url, api_key=RunDir(run_dir).api_key(), log_path=tmp_path / "r.log")
    check_rejoined(control, router, victim.url, run_dir, job)
    back_kill = last_probe(run_dir)  # probes list it once it is routed (one may be under way now)
    # the probe of back_kill + 1 may have begun before it was routed; the two after it may not
    wait_for(lambda: last_probe(run_dir) >= back_kill + 3, 300, "two syncs after the restart", run_dir, job)

    # b) A hung: alive, answering nothing, just before the trainer's next sync
    hung = engine_record(control, survivor)
    assert hung.restarts == 0
    v_hung = at_next_commit(run_dir, job) + 1
    os.killpg(hung.pid, signal.SIGSTOP)  # the server's whole process tree
    try:
        wait_for(lambda: restarted(hung.url, hung.pid), 500, f"hung {hung.url} restarted", run_dir, job)
        check_rejoined(control, router, hung.url, run_dir, job)
        back_hung = last_probe(run_dir)
        wait_for(lambda: last_probe(run_dir) >= back_hung + 3, 300, "two syncs after the restart", run_dir, job)
    finally:
        if pid_alive(hung.pid):  # the supervisor should have killed it; never leave a stopped tree behind
            os.killpg(hung.pid, signal.SIGKILL)
    ids, before_stop = stop_and_check(slurm_cluster, run_dir, job)

    check_no_stale_samples(run_dir)
    recs = probes(run_dir)
    first = by_version(recs, len(ids))  # one sync + probe per rollout (and per repeated publish)
    check_probe_entries(recs)
    recs = [r for r in recs if r["version"] <= before_stop]  # a sync in flight at the stop met engines shutting down
    assert restarts_in_metrics(run_dir) >= 2  # counted in the rollout metrics
    assert killed_rec.restarts == 1

    # a) before the kill both engines matched; the sync right after the kill went to the survivor
    # over the broadcast group (a dead engine refuses connections and is left out at once), never
    # through the disk fallback; the syncs after the restart reached both
    assert all(r["match"] and len(r["engines"]) == 2 for r in recs if r["version"] < v_kill)
    assert all(r["engines"][survivor]["same"] for r in recs if r["version"] < v_hung), recs
    assert first[v_kill]["engines"][survivor]["weight_version"] == str(v_kill)
    later = [r for r in recs if back_kill + 2 <= r["version"] < v_hung]
    assert later and all(r["match"] and set(r["engines"]) == {survivor, victim.url} for r in later), later[:2]

    # b) the bound: the trainer's log of the failed try of v_hung, the only one that failed
    log = (run_dir / "logs/attempt-0/trainer-0.log").read_text(errors="replace")
    failed = [(int(ver), int(t), float(took)) for ver, t, _, took in _TRY.findall(log) if int(ver) <= before_stop]
    # a kill that lands inside the sync of v_kill (after its engines were checked) fails that try at once
    # (the connection breaks); the retry leaves the dead engine out
    assert [(v, t) for v, t, _ in failed if v != v_kill] == [(v_hung, 1)], failed
    assert all(t == 1 and took < 5 for v, t, took in failed if v == v_kill), failed
    # try 1 waits for the hung engine's pause_generation (its timeout, +5 s for the futures) and the bounded
    # teardown; try 2 leaves it out and goes to the other engine over the rebuilt group
    per_try = SYNC_TIMEOUT_S + 5 + CLEANUP_TIMEOUT_S + 5
    [(_, _, _, took)] = [t for t in _TRY.findall(log) if int(t[0]) == v_hung]
    assert SYNC_TIMEOUT_S - 0.5 <= float(took) <= per_try + 10, took
    assert "WEIGHT SYNC FALLBACK" not in log and "did not answer the last try" in log, log[-3000:]
    recs_all = assert_delivered_by(run_dir, "gloo", versions=set(range(1, before_stop + 1)))
    hung_sync = [d for d in recs_all if d["version"] == v_hung]
    assert hung_sync and hung_sync[0]["tries"] == 2 and hung_sync[0]["seconds"] <= per_try + 20, hung_sync
    fallback_probe = first[v_hung]  # the engine that answered took v_hung over the broadcast group
    assert fallback_probe["engines"][victim.url]["same"], fallback_probe
    assert str(fallback_probe["engines"][victim.url]["weight_version"]) == str(v_hung), fallback_probe
    later = [r for r in recs if r["version"] >= back_hung + 2]
    assert later and all(r["match"] and set(r["engines"]) == {hung.url, victim.url} for r in later), later[:2]

    # the rollout node held health checks while the sync ran and restarted the hung server only
    # after that hold ended (the trainer removed its update record, or the cap ran out)
    node_log = (run_dir / "logs/attempt-0/rollout-0.log").read_text(errors="replace")
    held = re.search(rf"weight update v{v_hung}: engine health checks were paused for ([\d.]+) s|"
                     rf"weight update v{v_hung} \(trainer pid \d+\) still marked in progress", node_log)
    restart = re.search(r"\(" + re.escape(hung.url) + r"\): unresponsive \(\d+ failed health checks\); restarting",
                        node_log)
    assert held and restart and held.start() < restart.start(), node_log[-4000:]
