"""The rollout driver on two real SGLang servers (CPU, fp32) behind the real sglang-router.

Uses `private_deployment` (engines launched with `--weight-version 0`; shared with
test_partial_rollout.py, reset for each module): these tests change the engines' weight version
and kill one, so test_engines.py (the same deployment, checked from its start) runs before them
(tests/conftest.py). Server tests run in file order.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from rlslurm.buffer.control import Control
from rlslurm.buffer.reader import RolloutReader
from rlslurm.buffer.rundir import RunDir
from rlslurm.buffer.sample import SampleStatus
from rlslurm.buffer.writer import RolloutWriter
from rlslurm.engines.sglang_client import SGLangClient, SGLangError
from rlslurm.errors import DataError
from rlslurm.net import free_port
from rlslurm.rollout.driver import eval_metrics, gate_open, required_version, sampling_params
from rlslurm.rollout.router_context import RetryPolicy, RouterContext, parse_weight_version
from rlslurm.settings.config import RolloutSection, RunConfig
from tests.helpers.process_groups import pid_alive
from tests.rollout.helpers import make_cfg, make_driver, metrics_lines, set_version, write_prompts

# --- no servers ------------------------------------------------------------------------------


def test_required_version_bounds_how_far_ahead_the_driver_runs():
    assert [required_version(n, async_buffer_size=0) for n in range(4)] == [0, 1, 2, 3]
    assert [required_version(n, async_buffer_size=2) for n in range(5)] == [0, 0, 0, 1, 2]
    # weights published every 2nd rollout: version 3 never exists, rollout 3 may use version 2
    assert [required_version(n, async_buffer_size=0, update_weights_interval=2) for n in range(5)] == [0, 0, 2, 2, 4]


def test_gate_waits_for_every_engine_except_one_that_missed_an_update():
    assert gate_open({"a": 1, "b": 1}, 1, 1)
    assert not gate_open({"a": 1, "b": 0}, 1, 0)  # b is mid-update: wait for it
    assert not gate_open({"a": 1, "b": 0}, 1, None)
    assert gate_open({"a": 2, "b": 0}, 2, 2)  # b was restarted after version 2 was published
    assert not gate_open({"a": 0, "b": 0}, 2, 2)  # a new attempt: wait for the trainer to publish again
    assert not gate_open({}, 0, None)


def test_sampling_params_follow_the_flags():
    cfg = RunConfig(rollout=RolloutSection(rollout_temperature=0.7, rollout_top_p=0.9, rollout_top_k=5,
                                           rollout_max_response_len=33, rollout_stop=["."], eval_temperature=0.0,
                                           rollout_stop_token_ids=[2], eval_max_response_len=7))
    sp = sampling_params(cfg)
    assert (sp["temperature"], sp["top_p"], sp["top_k"], sp["max_new_tokens"]) == (0.7, 0.9, 5, 33)
    assert sp["stop"] == ["."] and sp["stop_token_ids"] == [2]
    ev = sampling_params(cfg, eval=True)
    assert (ev["temperature"], ev["max_new_tokens"]) == (0.0, 7)
    assert "stop" not in sampling_params(RunConfig())


def test_weight_version_must_be_an_integer_naming_the_engine():
    assert parse_weight_version("default", where="x") == 0 and parse_weight_version("12", where="x") == 12
    with pytest.raises(DataError, match="http://e:1/model_info.*'disk-2'"):
        parse_weight_version("disk-2", where="http://e:1/model_info")


def test_eval_metrics_pass_at_k():
    from rlslurm.buffer.sample import Sample

    def s(r):
        return Sample(prompt_tokens=[1], response_tokens=[2, 3], reward=r)

    m = eval_metrics("gsm", [[s(0.0), s(1.0)], [s(0.0), s(0.0)]], 2)
    assert m["eval/gsm/pass@2"] == 0.5 and m["eval/gsm/reward_mean"] == 0.25


def test_unreachable_router_is_retried_then_fails_naming_the_url():
    port = free_port()  # a port nobody listens on

    async def go():
        async with SGLangClient(f"http://127.0.0.1:{port}", "k") as c:
            ctx = RouterContext(c, None, retry=RetryPolicy(max_attempts=3, backoff_s=0.01))
            with pytest.raises(SGLangError, match=f"127.0.0.1:{port}/generate: no response"):
                await ctx.generate([1, 2], {"max_new_tokens": 2})
            return ctx.stats

    stats = asyncio.run(go())
    assert stats.requests == 3 and stats.retries == 2


def test_failures_while_the_supervisor_restarts_wait_for_it_within_a_bound():
    """A router restarted on a loaded node answered only after the tries ran out, and the rollout's
    failure cost the attempt (bench/results/chaos.md): while the supervisor is recovering, failures
    do not use up the tries, up to `recovery_wait_s`."""
    port = free_port()  # a port nobody listens on: the router is down
    asked = []

    def recovering() -> bool:  # a restart under way for the first three looks, then over
        asked.append(1)
        return len(asked) <= 3

    async def go(policy: RetryPolicy, recovering):
        async with SGLangClient(f"http://127.0.0.1:{port}", "k") as c:
            ctx = RouterContext(c, None, retry=policy, recovering=recovering)
            with pytest.raises(SGLangError, match="no response"):
                await ctx.generate([1, 2], {"max_new_tokens": 2})
            return ctx.stats

    stats = asyncio.run(go(RetryPolicy(max_attempts=3, backoff_s=0.01), recovering))
    assert stats.requests == 6 and len(asked) == 4  # 3 tries, 3 more while recovering, then given up
    # a recovery that never ends is waited for only so long
    stats = asyncio.run(go(RetryPolicy(max_attempts=2, backoff_s=0.01, recovery_wait_s=0.3), lambda: True))
    assert 2 < stats.requests < 100


# --- real servers ----------------------------------------------------------------------------


@pytest.mark.sglang
@pytest.mark.slow
def test_rollout_is_committed_with_logprobs_that_match_teacher_forcing(private_deployment, tmp_path):
    dep = private_deployment
    run = tmp_path / "run"
    cfg = make_cfg(write_prompts(tmp_path / "p.jsonl", 10), rollout_max_response_len=12)
    result = asyncio.run(make_driver(dep, cfg, run).run())
    assert result.reason == "done" and result.committed == [0]

    rollout = RolloutReader(run).read(0)
    samples = rollout.samples
    assert len(samples) == 16 and rollout.stats.n_groups == 4
    assert [s.group_index for s in samples] == [g for g in range(4) for _ in range(4)]
    assert [s.index for s in samples] == list(range(16))
    prompts = {s.metadata["prompt_index"] for s in samples}
    assert len(prompts) == 4
    src_cursor = rollout.meta.data_cursor
    assert src_cursor["position"] == 4 and src_cursor["pending"] == []
    for s in samples:
        n = s.response_length
        assert n >= 1 and s.rollout_logprobs.shape == (n,) and s.loss_mask.tolist() == [1] * n
        assert s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)
        assert n <= 12 and (s.status == SampleStatus.COMPLETED or n == 12)
        assert s.weight_version == 0
        assert s.label is not None and s.reward in (0.0, 1.0)
    # four samples of one prompt at temperature 1 are not all the same response
    assert any(len({tuple(s.response_tokens) for s in samples[g * 4:(g + 1) * 4]}) > 1 for g in range(4))

    vocab = json.loads((dep.model_path / "config.json").read_text())["vocab_size"]

    async def recompute() -> float:
        worst = 0.0
        async with SGLangClient(dep.supervisor.urls[0], dep.api_key) as c:
            for s in samples:
                p, resp = s.prompt_tokens.tolist(), s.response_tokens.tolist()
                tf = await c.generate(p + resp, {"max_new_tokens": 0}, logprob_start_len=len(p) - 1)
                entries = tf["meta_info"]["input_token_logprobs"][1:]
                # SGLang shows the last vocab id as 0 here (see test_engines.py); values are right
                assert [t for _, t, _ in entries] == [t if t < vocab - 1 else 0 for t in resp]
                worst = max(worst, max(abs(a - lp) for (lp, _, _), a in zip(entries, s.rollout_logprobs.tolist())))
        return worst

    assert asyncio.run(recompute()) < 1e-4
    [line] = metrics_lines(run)
    assert line["rollout_id"] == 0 and line["kind"] == "train" and line["rollout/samples"] == 16
    assert line["rollout/engine/requests"] == 16 and line["rollout/engine/output_tokens"] == sum(
        s.response_length for s in samples)


@pytest.mark.sglang
@pytest.mark.slow
def test_bad_sampling_param_fails_at_once_naming_the_url(private_deployment):
    dep = private_deployment

    async def go():
        async with SGLangClient(dep.router.url, dep.api_key) as c:
            ctx = RouterContext(c, None, retry=RetryPolicy(max_attempts=5, backoff_s=0.01))
            with pytest.raises(SGLangError, match=r"/generate: HTTP 4\d\d"):
                await ctx.generate([5, 6], {"max_new_tokens": 2, "temperature": -3.0})
            return ctx.stats

    assert asyncio.run(go()).retries == 0


@pytest.mark.sglang
@pytest.mark.slow
def test_restarted_driver_resumes_from_the_committed_cursor(private_deployment, tmp_path):
    """Stopped in the middle of rollout 2: nothing of it is committed; a new driver (fresh
    prompt source) commits 2 and 3; the 4 rollouts use every prompt exactly once. Eval runs
    every 2 rollouts and is not repeated after the restart."""
    dep = private_deployment
    run = tmp_path / "run"
    evalp = write_prompts(tmp_path / "eval.jsonl", 3, offset=5)
    cfg = make_cfg(write_prompts(tmp_path / "p.jsonl", 12), num_rollout=4, rollout_batch_size=3,
                   n_samples_per_prompt=2, rollout_max_response_len=48, eval_interval=2, async_buffer_size=4,
                   eval_prompt_data=["tiny", str(evalp)], n_samples_per_eval_prompt=2, eval_max_response_len=4)
    writer = RolloutWriter(RunDir.create(run))
    eval_writer = RolloutWriter(run, kind="eval")
    first = make_driver(dep, cfg, run)
    mark: list[int] = []

    def stop() -> bool:
        # Stop once eval 2 is committed, i.e. when rollout 2 is about to start or under way (a stop
        # keyed to "one of its requests returned" came too late on a fast machine: the whole tiny
        # rollout had finished by the next check). Either way nothing of rollout 2 may be committed.
        if not mark and eval_writer.is_committed(2):
            mark.append(first.ctx.stats.output_tokens)
        return bool(mark)

    r1 = asyncio.run(first.run(stop))
    assert r1.reason == "stopped" and r1.committed == [0, 1] and r1.evaluated == [0, 2]
    assert writer.committed_ids() == [0, 1], "the stop came too late: make the rollouts longer"

    second = make_driver(dep, cfg, run)
    r2 = asyncio.run(second.run())
    assert r2.reason == "done" and r2.committed == [2, 3] and r2.evaluated == []
    reader = RolloutReader(run)
    used = [s.metadata["prompt_index"] for rid in range(4) for s in reader.read(rid).samples[::2]]
    assert sorted(used) == list(range(12)), used
    assert reader.read(3).meta.data_cursor["position"] == 12

    ev = RolloutReader(run, kind="eval")
    assert ev.committed_ids() == [0, 2]
    e0 = ev.read(0)
    assert len(e0.samples) == 6 and {s.metadata["eval_dataset"] for s in e0.samples} == {"tiny"}
    assert all(s.response_length <= 4 for s in e0.samples)
    evals = [m for m in metrics_lines(run) if m["kind"] == "eval"]
    assert [m["rollout_id"] for m in evals] == [0, 2]
    assert 0.0 <= evals[0]["eval/tiny/pass@2"] <= 1.0 and evals[0]["eval/tiny/prompts"] == 3
    assert [m["rollout_id"] for m in metrics_lines(run) if m["kind"] == "train"] == [0, 1, 2, 3]


@pytest.mark.sglang
@pytest.mark.slow
def test_debug_rollout_only_generates_with_the_initial_weights_until_the_prompts_run_out(private_deployment, tmp_path):
    """--debug-rollout-only: no trainer publishes, so synchronous rollouts 1, 2 (which would wait for
    versions 1, 2) are generated right after rollout 0, all at version 0. Five prompts fill two
    rollouts of 2, not a third: the driver records that in control/ for this attempt, and the
    trainer step's watcher (as the trainer) then ends the run instead of waiting for rollout 2."""
    from rlslurm.trainer.rollout_only import _verdict

    dep = private_deployment
    asyncio.run(set_version(dep, 0))
    run = tmp_path / "run"
    cfg = make_cfg(write_prompts(tmp_path / "p.jsonl", 5), num_rollout=3, rollout_batch_size=2,
                   n_samples_per_prompt=2, rollout_max_response_len=8)
    cfg.train.debug_rollout_only = True
    cfg.data.num_epoch = 1  # a cap: without --num-epoch the prompts cycle, as slime's do
    result = asyncio.run(asyncio.wait_for(make_driver(dep, cfg, run).run(), 120))
    assert result.reason == "exhausted" and result.committed == [0, 1]
    reader = RolloutReader(run)
    assert all(s.weight_version == 0 for i in range(2) for s in reader.read(i).samples)
    control = Control(run)
    rec = control.data_exhausted(attempt=0)
    assert rec is not None and rec.rollout_id == 2 and "1 of --rollout-batch-size 2 groups" in rec.message
    assert control.data_exhausted(attempt=1) is None  # a later attempt (more data, maybe) ignores it
    rd = RunDir(run)
    assert _verdict(cfg, rd, control, lambda: False, 0) == "exhausted"
    assert _verdict(cfg, rd, control, lambda: False, 1) is None


@pytest.mark.sglang
@pytest.mark.slow
def test_disk_mode_waits_for_the_trainer_and_loads_its_weights(private_deployment, tmp_path):
    """Sync mode: rollout 1 waits for version 1; when the trainer publishes weights/v1 the
    driver loads them into both engines and the samples record version 1."""
    dep = private_deployment
    run = tmp_path / "run"
    cfg = make_cfg(write_prompts(tmp_path / "p.jsonl", 8), num_rollout=2, rollout_batch_size=2,
                   n_samples_per_prompt=2, weight_sync="disk")
    driver = make_driver(dep, cfg, run)
    writer = RolloutWriter(run)

    async def scenario():
        task = asyncio.ensure_future(driver.run())
        while not writer.is_committed(0):
            await asyncio.sleep(0.05)
        await asyncio.sleep(2.0)
        assert not task.done() and not writer.is_committed(1), "rollout 1 did not wait for weight version 1"
        # the trainer's DiskPublisher: weights/v1 complete, then the control record
        shutil.copytree(dep.model_path, run / "weights" / "v1")
        Control(run).set_weight_version(1)
        return await asyncio.wait_for(task, 120)

    result = asyncio.run(scenario())
    assert result.committed == [0, 1]
    reader = RolloutReader(run)
    assert {s.weight_version for s in reader.read(0).samples} == {0}
    assert {s.weight_version for s in reader.read(1).samples} == {1}

    async def versions():
        out = []
        for url in dep.supervisor.urls:
            async with SGLangClient(url, dep.api_key) as c:
                out.append(await c.get_weight_version())
        return out

    assert asyncio.run(versions()) == ["1", "1"]


@pytest.mark.sglang
@pytest.mark.slow
def test_requests_aborted_by_a_weight_update_pause_are_generated_again(private_deployment, tmp_path):
    """What a distributed weight update does to the engines mid-rollout (async mode): pause in
    abort mode, then continue. Aborted groups go back to the source and are generated again;
    the rollout commits complete groups only, with no prompt lost or repeated."""
    dep = private_deployment
    run = tmp_path / "run"
    cfg = make_cfg(write_prompts(tmp_path / "p.jsonl", 8), rollout_batch_size=4, n_samples_per_prompt=2,
                   rollout_max_response_len=96, async_buffer_size=4)
    driver = make_driver(dep, cfg, run)

    async def pause_all(pause: bool):
        for url in dep.supervisor.urls:
            async with SGLangClient(url, dep.api_key) as c:
                await (c.pause_generation("abort") if pause else c.continue_generation())

    async def scenario():
        task = asyncio.ensure_future(driver.run())
        while driver.ctx is None or driver.ctx.stats.output_tokens < 20:
            await asyncio.sleep(0.02)
        await pause_all(True)
        await asyncio.sleep(1.0)
        await pause_all(False)
        return await asyncio.wait_for(task, 300)

    result = asyncio.run(scenario())
    assert result.committed == [0]
    r0 = RolloutReader(run).read(0)
    assert all(s.status != SampleStatus.ABORTED for s in r0.samples) and len(r0.samples) == 8
    assert len({s.metadata["prompt_index"] for s in r0.samples}) == 4
    [line] = metrics_lines(run)
    if line["rollout/engine/aborted"] == 0:
        pytest.fail("no request was in flight at the pause: make the responses longer")
    assert line["rollout/filter/groups_returned"] >= 1
    # the aborted prompts are served first next time: the cursor keeps them as pending
    cursor = r0.meta.data_cursor
    served = {s.metadata["prompt_index"] for s in r0.samples}
    pending = {p["index"] for p in cursor["pending"]}
    assert not pending & served and len(served) + len(pending) == cursor["position"]


@pytest.mark.sglang
@pytest.mark.slow
def test_other_nodes_find_the_router_in_control_and_never_start_one(private_deployment, tmp_path):
    from rlslurm.engines.router import RouterError
    from rlslurm.rollout.node import RemoteRouter, RolloutNode
    from rlslurm.settings.config import RunConfig

    dep = private_deployment
    rd = RunDir.create(tmp_path / "run")
    rd.api_key_file.write_text(dep.api_key + "\n")  # the job's key, as node 0 created it
    control = Control(rd)
    node = RolloutNode(RunConfig(), rd, node=1, node_name="n1", host="127.0.0.1", attempt=0)
    control.write_router(f"http://127.0.0.1:{free_port()}")  # a record left by a previous attempt: nobody listens there
    with pytest.raises(RouterError, match="no live router"):
        node._remote_router(cancel=lambda: True)
    control.write_router(dep.router.url)
    router = node._remote_router(cancel=lambda: False)
    try:
        assert isinstance(router, RemoteRouter) and router.url == dep.router.url and router.is_alive()
        assert {w["url"] for w in router.workers() if w["is_healthy"]} == set(dep.supervisor.urls)
        router.close()  # closes its HTTP client only: node 0's router keeps running
        assert dep.router.is_alive()
    finally:
        router._http.close()


@pytest.mark.sglang
@pytest.mark.slow
def test_kill9_of_an_engine_during_a_rollout(private_deployment, tmp_path):
    """The rollout completes (the router and the driver retry on the other engine), the
    engine is restarted and the restart counted; back at version 0 while version 1 is published,
    it stays out of the router (the rollout node's `weights_current` admission) until the next
    rollout's driver has loaded version 1 into it, and is routed again after that."""
    from rlslurm.rollout.node import weights_current

    dep = private_deployment
    sup = dep.supervisor
    run = tmp_path / "run"
    RunDir.create(run)
    shutil.copytree(dep.model_path, run / "weights" / "v1")
    Control(run).set_weight_version(1)  # as after the disk test: the trainer trained rollout 0
    sup.admit = weights_current(Control(run), dep.api_key)  # what RolloutNode gives its supervisor
    cfg = make_cfg(write_prompts(tmp_path / "p.jsonl", 16), num_rollout=1, rollout_batch_size=8,
                   n_samples_per_prompt=4, rollout_max_response_len=96)
    victim = sup.process("engine-1")
    old_pid, old_tree, old_files = victim.pid, victim.tree_pids(), set(victim._owned_files)
    assert old_files, "the engine's /dev/shm files were not identified"
    driver = make_driver(dep, cfg, run)
    writer = RolloutWriter(run)

    async def scenario():
        task = asyncio.ensure_future(driver.run())
        while driver.ctx is None or driver.ctx.stats.output_tokens < 60:
            await asyncio.sleep(0.02)
        assert not writer.is_committed(0), "the rollout finished before the kill; make it longer"
        os.kill(old_pid, signal.SIGKILL)
        return await asyncio.wait_for(task, 400)

    result = asyncio.run(scenario())
    assert result.committed == [0]
    r0 = RolloutReader(run).read(0)
    assert len(r0.samples) == 32 and all(s.status != SampleStatus.ABORTED for s in r0.samples)

    deadline = time.monotonic() + 240
    while sup.restarts_total < 1 and time.monotonic() < deadline:
        time.sleep(0.5)
    def victim_info():
        return next(i for i in sup.engines() if i.name == "engine-1")

    info = victim_info()
    assert info.restarts == 1 and info.healthy and info.pid != old_pid
    # the supervisor reaped the whole old tree (the kill hit the HTTP server only) and its files
    assert not any(pid_alive(p) for p in old_tree), "old engine processes survived the restart"
    assert not any(os.path.exists(f) for f in old_files), "old engine's /dev/shm files were left"

    async def version(url):
        async with SGLangClient(url, dep.api_key) as c:
            return await c.get_weight_version()

    assert asyncio.run(version(info.url)) == "0"  # a restarted engine holds the HF weights again
    time.sleep(3 * sup.health_interval_s)  # health rounds ask it again: still behind, still out
    info = victim_info()
    assert info.awaiting_weights and info.healthy and info.worker_id is None
    assert info.url not in {w["url"] for w in dep.router.workers()}
    # the driver restarted for rollout 1 (needs version 1) brings it to version 1 first
    cfg.rollout.num_rollout = 2
    result = asyncio.run(make_driver(dep, cfg, run).run())
    assert result.committed == [1]
    assert asyncio.run(version(info.url)) == "1"
    assert {s.weight_version for s in RolloutReader(run).read(1).samples} == {1}
    assert metrics_lines(run)[-1]["rollout/engine/restarts_total"] == 1
    deadline = time.monotonic() + 30  # admitted at the next health round
    while victim_info().awaiting_weights and time.monotonic() < deadline:
        time.sleep(0.2)
    info = victim_info()
    assert not info.awaiting_weights and info.worker_id is not None
    workers = {w["url"]: w for w in dep.router.workers()}
    assert workers[info.url]["is_healthy"] and workers[info.url]["id"] == info.worker_id
    assert [w["id"] for w in dep.router.workers()].count(info.worker_id) == 1


@pytest.mark.sglang
@pytest.mark.slow
def test_sliced_prompts_and_eval_config_through_the_driver(private_deployment, tmp_path):
    """--prompt-data PATH@[4:10], --eval-config (two datasets: one sliced with its own sample count,
    max lengths from defaults and the entry) and --skip-eval-before-train: the rollouts use only the
    slice, the cursor records it, and eval runs before rollout 1 but not 0. And
    --rollout-sample-filter-path: the second sample of each group is stored untrained (zero mask)."""
    dep = private_deployment
    run = tmp_path / "run"
    prompts = write_prompts(tmp_path / "p.jsonl", 12)
    write_prompts(tmp_path / "a.jsonl", 5, offset=3)
    write_prompts(tmp_path / "b.jsonl", 2, offset=9)
    (tmp_path / "eval.yaml").write_text(
        "eval:\n  defaults: {max_response_len: 3}\n  datasets:\n"
        "    - {name: a, path: 'a.jsonl@[-2:]', n_samples_per_eval_prompt: 2}\n"
        "    - {name: b, path: b.jsonl, max_response_len: 5, rm_type: exact}\n")
    cfg = make_cfg(Path(f"{prompts}@[4:10]"), num_rollout=2, rollout_batch_size=3, n_samples_per_prompt=2,
                   eval_interval=1, skip_eval_before_train=True, async_buffer_size=4)
    cfg.data.eval_config = tmp_path / "eval.yaml"
    (tmp_path / "sample_filter.py").write_text("def first_of_group(samples):\n"
                                               "    return [s.index % 2 == 0 for s in samples]\n")
    cfg.rollout.rollout_sample_filter_path = f"{tmp_path / 'sample_filter.py'}:first_of_group"
    r = asyncio.run(make_driver(dep, cfg, run).run())
    assert r.reason == "done" and r.committed == [0, 1] and r.evaluated == [1]
    reader = RolloutReader(run)
    for rid in range(2):
        samples = reader.read(rid).samples
        assert [bool(s.effective_loss_mask().any()) for s in samples] == [True, False] * 3
        assert all(s.response_length >= 1 for s in samples)  # removed from the loss, not from the rollout
    trains = [m for m in metrics_lines(run) if m["kind"] == "train"]
    assert [m["rollout/sample_filter/removed"] for m in trains] == [3.0, 3.0]
    used = sorted(s.metadata["prompt_index"] for rid in range(2) for s in reader.read(rid).samples[::2])
    assert used == [4, 5, 6, 7, 8, 9]
    assert reader.read(1).meta.data_cursor["slice"] == [4, 10]
    e1 = RolloutReader(run, kind="eval").read(1)
    by = {n: [s for s in e1.samples if s.metadata["eval_dataset"] == n] for n in "ab"}
    assert len(by["a"]) == 4 and len(by["b"]) == 2
    assert sorted({s.metadata["prompt_index"] for s in by["a"]}) == [3, 4]
    assert all(s.response_length <= 3 for s in by["a"]) and all(s.response_length <= 5 for s in by["b"])
    evals = [m for m in metrics_lines(run) if m["kind"] == "eval"]
    assert [m["rollout_id"] for m in evals] == [1]
    assert evals[0]["eval/a/prompts"] == 2 and "eval/a/pass@2" in evals[0] and "eval/b/pass@1" in evals[0]
