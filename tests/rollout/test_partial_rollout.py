"""Partial rollout (--partial-rollout, --mask-offpolicy-in-partial-rollout) and regeneration of
quarantined rollouts, through the real driver on two real SGLang servers behind the real router.

The engines' weight version is set with SGLang's /update_weight_version: the weights stay the HF
ones, but every token an engine generates is labelled with that version, which is all the
partial-rollout bookkeeping and the weight gate look at. Each server test sets the version it
starts from, so the tests do not depend on their order.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import numpy as np
import pytest

from rlslurm.buffer.reader import RolloutReader
from rlslurm.buffer.rundir import RunDir
from rlslurm.buffer.sample import RolloutMeta, Sample, SampleStatus
from rlslurm.buffer.writer import RolloutWriter
from rlslurm.errors import ConfigError, DataError
from rlslurm.rollout.data import PartialSample
from rlslurm.rollout.generate_api import (
    ENV_VERSION,
    META_CARRIED,
    META_MASKED,
    META_RUNS,
    GenerateOutput,
    Generation,
)
from tests.buffer.damage import flip_data_middle
from tests.rollout.helpers import make_cfg, make_driver, metrics_lines, set_version, start_rollout_main, write_prompts

# --- no servers ------------------------------------------------------------------------------


def out(ids: list[int], version: int, finish: str = "abort") -> GenerateOutput:
    return GenerateOutput(output_ids=ids, output_logprobs=[-0.5] * len(ids), finish_reason=finish,
                          weight_version=version)


def test_offpolicy_mask_keeps_only_the_newest_weights_tokens():
    g = Generation()
    g.append_model(out([5, 6, 7], 0))
    g.append_env([8, 9])                      # a tool's output: never trained
    back = Generation.from_partial(PartialSample.from_json(json.loads(json.dumps(g.to_partial().to_json()))))
    assert back.version_runs == [[3, 0], [2, ENV_VERSION]] and back.carried == 5
    back.append_model(out([10], 1))
    back.append_model(out([11, 12], 2, "stop"))
    assert back.mask_offpolicy("s") == 4      # three v0 tokens, one v1 token; env tokens were 0 already
    assert back.loss_mask == [0, 0, 0, 0, 0, 0, 1, 1] and back.weight_version == 2
    meta = back.to_sample([1]).metadata
    assert meta[META_RUNS] == [[3, 0], [2, ENV_VERSION], [1, 1], [2, 2]] and meta[META_CARRIED] == 5

    same = Generation()
    same.append_model(out([5, 6], 3))
    same = Generation.from_partial(same.to_partial())
    same.append_model(out([7], 3, "length"))
    assert same.mask_offpolicy("s") == 0 and same.loss_mask == [1, 1, 1]  # one version: nothing is older
    assert META_RUNS not in same.to_sample([1]).metadata

    edited = Generation()
    edited.append_model(out([5], 0))
    edited.response_ids.append(6)             # a custom function bypassing append_*: versions unknown
    edited.response_logprobs.append(0.0)
    edited.loss_mask.append(1)
    assert edited.to_partial().version_runs is None
    assert edited.mask_offpolicy("fresh") == 0  # nothing carried: nothing can be older
    edited.carried = 1
    with pytest.raises(DataError, match="prompt 3 sample 1.*append_model"):
        edited.mask_offpolicy("prompt 3 sample 1")
    with pytest.raises(DataError, match="do not cover"):
        PartialSample(output_ids=[1, 2], output_logprobs=[0.0, 0.0], loss_mask=[1, 1], weight_version=0,
                      version_runs=[[1, 0]])


def test_mask_flag_needs_partial_rollout():
    from rlslurm.settings.flags import build_config, parse_flags

    with pytest.raises(ConfigError, match="--mask-offpolicy-in-partial-rollout: needs --partial-rollout"):
        build_config([parse_flags(["--mask-offpolicy-in-partial-rollout"])])
    cfg = build_config([parse_flags(["--partial-rollout", "--mask-offpolicy-in-partial-rollout"])])
    assert cfg.rollout.partial_rollout and cfg.rollout.mask_offpolicy_in_partial_rollout


def test_handback_applies_only_on_top_of_the_commit_it_was_saved_after(tmp_path):
    w = RolloutWriter(RunDir.create(tmp_path / "run"))
    w.save_handback({"position": 3})          # stopped before any commit
    rp = w.resume_point()
    assert rp.from_handback and rp.data_cursor == {"position": 3} and rp.next_rollout_id == 0
    s = Sample(prompt_tokens=[1], response_tokens=[2])
    w.commit(0, [s], RolloutMeta(data_cursor={"position": 4}))
    rp = w.resume_point()                     # a commit after the hand-back wins (even if it was not cleared)
    assert not rp.from_handback and rp.data_cursor == {"position": 4} and rp.next_rollout_id == 1
    w.save_handback({"position": 7})
    assert w.resume_point().data_cursor == {"position": 7}
    w.clear_handback()
    assert not w.handback_file.exists() and w.resume_point().data_cursor == {"position": 4}


# --- real servers ----------------------------------------------------------------------------


def pending_of(cursor: dict) -> dict[int, list[dict] | None]:
    return {p["index"]: p["partial"] for p in cursor["pending"]}


def check_continued(rollout, pending: dict[int, list[dict] | None], *, newer: int) -> dict[str, int]:
    """Every sample of a continued group starts with the tokens it carried; tokens the older
    weights generated are masked exactly where a newer segment followed them."""
    n_cut = carried = masked = 0
    by_prompt: dict[int, list] = {}
    for s in rollout.samples:
        by_prompt.setdefault(s.metadata["prompt_index"], []).append(s)
    for index, samples in by_prompt.items():
        partial = pending.get(index)
        if partial is None:
            continue
        assert len(samples) == len(partial)
        for s, p in zip(samples, partial):
            k = len(p["output_ids"])
            assert s.response_tokens[:k].tolist() == p["output_ids"], (index, k)
            np.testing.assert_allclose(s.rollout_logprobs[:k], p["output_logprobs"], rtol=0, atol=1e-6)
            grown = s.response_length - k
            if p["status"] in ("completed", "truncated"):
                assert grown == 0 and s.weight_version == p["weight_version"]  # finished before the cut: as it was
            if p["status"] == "aborted" and k and grown:
                n_cut += 1
                assert s.loss_mask.tolist() == [0] * k + [1] * grown
                assert s.metadata[META_RUNS] == [[k, p["weight_version"]], [grown, newer]]
                assert s.metadata[META_MASKED] == k and s.weight_version == newer
                masked += k
            else:
                assert s.loss_mask.tolist() == [1] * s.response_length
            assert s.metadata.get(META_CARRIED, 0) == k
            carried += k
            assert s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)
    return {"cut": n_cut, "carried": carried, "masked": masked}


@pytest.mark.sglang
@pytest.mark.slow
def test_a_stopped_rollout_is_continued_by_the_next_driver(private_deployment, tmp_path):
    """A stop mid-rollout (what a preempt does): the driver aborts its requests and saves the cursor
    with every drawn group handed back, with its tokens so far. A new driver (a new attempt) under
    newer weights continues exactly those groups; generated + carried tokens = committed tokens."""
    dep = private_deployment
    asyncio.run(set_version(dep, 0))
    run = tmp_path / "run"
    cfg = make_cfg(write_prompts(tmp_path / "p.jsonl", 12), rollout_batch_size=4, n_samples_per_prompt=2,
                   rollout_max_response_len=160, partial_rollout=True, mask_offpolicy_in_partial_rollout=True,
                   weight_sync="distributed")
    first = make_driver(dep, cfg, run)
    # stop as soon as one request came back: the others are mid-generation then
    r1 = asyncio.run(first.run(lambda: first.ctx is not None and first.ctx.stats.requests > 0
                                       and first.ctx.stats.output_tokens > 0))
    writer = RolloutWriter(run)
    assert r1.reason == "stopped" and r1.committed == [] and writer.committed_ids() == []
    assert r1.handback == writer.handback_file
    saved = json.loads(writer.handback_file.read_text())
    assert saved["base"] is None  # continues from "nothing committed"
    pending = pending_of(saved["data_cursor"])
    assert len(pending) == 4 and saved["data_cursor"]["position"] == 4  # all drawn, all handed back
    cut = [p for ps in pending.values() if ps for p in ps if p["status"] == "aborted" and p["output_ids"]]
    if not cut:
        pytest.fail(f"no sample was cut mid-generation by the stop: make the responses longer ({pending})")
    assert all(p["weight_version"] == 0 and p["version_runs"] is None for p in cut)  # one segment, of v0

    asyncio.run(set_version(dep, 1))  # the trainer published new weights meanwhile
    second = make_driver(dep, cfg, run)
    r2 = asyncio.run(second.run())
    assert r2.reason == "done" and r2.committed == [0]
    r0 = RolloutReader(run).read(0)
    assert {s.metadata["prompt_index"] for s in r0.samples} == set(pending)  # the same groups, continued
    got = check_continued(r0, pending, newer=1)
    assert got["cut"] >= 1
    total = sum(s.response_length for s in r0.samples)
    assert second.ctx.stats.output_tokens == total - got["carried"]  # token counts add up
    assert r0.meta.data_cursor["position"] == 4 and r0.meta.data_cursor["pending"] == []
    assert not writer.handback_file.exists() and writer.resume_point().next_rollout_id == 1
    [line] = metrics_lines(run)
    assert line["rollout/partial/carried_tokens"] == got["carried"]
    assert line["rollout/partial/masked_tokens"] == got["masked"]
    assert line["rollout/weight_version_max"] == 1


@pytest.mark.sglang
@pytest.mark.slow
def test_groups_cut_off_by_a_full_batch_continue_in_the_next_rollout(private_deployment, tmp_path):
    """Over-sampling: the batch fills while other groups still generate; they are aborted and their
    tokens so far travel in the committed cursor to the next rollout, which continues them.

    That some group is cut mid-generation depends on the random model's lengths (EOS ~1.4 % per token,
    ~11 % of samples reach the 160-token cap): every other group must still be generating when the
    batch fills and the driver's abort lands. With 6 groups drawn for 2, all 4 others had finished
    by then in ~0.2 % of draws with an instant abort and ~3 % with an abort 40 tokens late (a loaded
    2-core machine; a simulation of these lengths, geometric per prompt); once in CI none was cut. 10
    groups drawn for 2 leave 8 to be cut: ~0.05 % at 40 tokens late."""
    dep = private_deployment
    asyncio.run(set_version(dep, 0))
    run = tmp_path / "run"
    cfg = make_cfg(write_prompts(tmp_path / "p.jsonl", 12), num_rollout=1, rollout_batch_size=2,
                   over_sampling_batch_size=10, n_samples_per_prompt=2, rollout_max_response_len=160,
                   partial_rollout=True, mask_offpolicy_in_partial_rollout=True, async_buffer_size=1,
                   weight_sync="distributed", rollout_max_concurrency=20)  # every drawn sample in flight at once
    assert asyncio.run(make_driver(dep, cfg, run).run()).committed == [0]
    r0 = RolloutReader(run).read(0)
    pending = pending_of(r0.meta.data_cursor)
    assert len(pending) == 8 and r0.meta.data_cursor["position"] == 10
    assert not {s.metadata["prompt_index"] for s in r0.samples} & set(pending)

    asyncio.run(set_version(dep, 1))
    # the next rollout takes exactly the 8 handed-back groups (pending prompts are served first)
    cfg.rollout.num_rollout, cfg.rollout.rollout_batch_size, cfg.rollout.over_sampling_batch_size = 2, 8, 8
    assert asyncio.run(make_driver(dep, cfg, run).run()).committed == [1]
    r1 = RolloutReader(run).read(1)
    assert {s.metadata["prompt_index"] for s in r1.samples} == set(pending)
    got = check_continued(r1, pending, newer=1)
    if not got["cut"]:
        pytest.fail(f"no group was cut mid-generation when the batch filled: make the responses longer ({pending})")
    # nothing lost, nothing repeated: the 10 drawn prompts are used once
    used = [s.metadata["prompt_index"] for r in (r0, r1) for s in r.samples[::2]]
    assert len(set(used)) == len(used) == 10 and r1.meta.data_cursor == {**r1.meta.data_cursor, "position": 10,
                                                                          "pending": []}


@pytest.mark.sglang
@pytest.mark.slow
def test_a_rollout_quarantined_mid_run_is_regenerated_before_the_next(private_deployment, tmp_path):
    """Sync mode: the driver has committed rollout 0 and waits for weight version 1; the trainer
    finds rollout 0 corrupt, quarantines it and waits for it. The driver must regenerate it
    now (not at its next restart, which never comes: both would wait forever)."""
    dep = private_deployment
    asyncio.run(set_version(dep, 0))
    run = tmp_path / "run"
    cfg = make_cfg(write_prompts(tmp_path / "p.jsonl", 12), num_rollout=2, rollout_batch_size=2,
                   n_samples_per_prompt=2, rollout_max_response_len=8, weight_sync="distributed")
    driver = make_driver(dep, cfg, run)
    writer = RolloutWriter(run)

    async def scenario():
        task = asyncio.ensure_future(driver.run())
        while not writer.is_committed(0):
            await asyncio.sleep(0.05)
        first = RolloutReader(run).read(0)
        flip_data_middle(writer, 0)
        # the trainer: reads rollout 0, quarantines the corrupt commit, waits for the regenerated one
        again = await asyncio.to_thread(RolloutReader(run).wait_for, 0, 120)
        assert not task.done() and not writer.is_committed(1), "rollout 1 must still wait for version 1"
        await set_version(dep, 1)  # the trainer trained rollout 0 and published
        return first, again, await asyncio.wait_for(task, 120)

    first, again, result = asyncio.run(scenario())
    assert result.reason == "done" and result.regenerated == [0] and result.committed == [0, 0, 1]
    assert [q["rollout_id"] for q in writer.quarantined()] == [0]
    r1 = RolloutReader(run).read(1)
    groups = [s.metadata["prompt_index"] for r in (first, again, r1) for s in r.samples[::2]]
    # the corrupt rollout's prompts were consumed; the regenerated one and rollout 1 take the next ones
    assert len(set(groups)) == 6 and r1.meta.data_cursor["position"] == 6, groups
    assert {s.weight_version for s in again.samples} == {0} and {s.weight_version for s in r1.samples} == {1}
    assert [(m["rollout_id"], m["kind"]) for m in metrics_lines(run)] == [(0, "train"), (0, "train"), (1, "train")]


@pytest.mark.sglang
@pytest.mark.slow
def test_rollout_main_stops_the_driver_at_a_preempt_request_and_keeps_its_groups(tmp_path, tiny_model):
    """`python -m rlslurm.rollout.main` (local mode): at the batch script's preempt request the
    driver stops mid-rollout and saves its hand-back while the engines still run; the process
    exits only after the trainer's ack."""
    from rlslurm.buffer.atomic import write_json_atomic
    from rlslurm.buffer.control import Control
    from rlslurm.settings.config import DataSection, ModelSection, RolloutSection, RunConfig, RunSection, SlurmSection
    from rlslurm.settings.runfile import dump_run_config

    cfg = RunConfig(run=RunSection(device="cpu"), slurm=SlurmSection(gpus_per_node=0),
                    model=ModelSection(model="tiny-qwen3", hf_checkpoint=tiny_model),
                    data=DataSection(prompt_data=write_prompts(tmp_path / "p.jsonl", 64)),
                    rollout=RolloutSection(num_rollout=50, rollout_batch_size=4, n_samples_per_prompt=2,
                                           rollout_max_response_len=160, rm_type="exact", engines_per_node=1,
                                           async_buffer_size=50, partial_rollout=True, rollout_dtype="float32",
                                           engine_health_interval_s=2.0),
                    sglang_args=["--max-total-tokens", "4096", "--mem-fraction-static", "0.3"])
    rd = RunDir.create(tmp_path / "run")
    rd.ensure_api_key()
    rd.run_yaml.write_text(dump_run_config(cfg))
    control, writer = Control(rd), RolloutWriter(rd)
    proc = start_rollout_main(rd)
    log = rd.path / "rollout.log"
    try:
        deadline = time.monotonic() + 400
        while not writer.is_committed(0):  # async mode: rollout 1 is generating right after this
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        write_json_atomic(control.preempt_file, {"requested_at": time.time(), "job_id": "0", "attempt": 0})
        while not writer.handback_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(2)
        assert proc.poll() is None, "the node must keep its engines until the trainer acks"
        control.ack_preempt(checkpoint_iteration=-1)
        assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    saved = json.loads(writer.handback_file.read_text())
    newest = writer.committed_ids()[-1]
    assert saved["base"]["rollout_id"] == newest
    resume = writer.resume_point()
    assert resume.from_handback and resume.next_rollout_id == newest + 1
    assert newest < cfg.rollout.num_rollout - 1, "the driver ran to the end past the preempt request"
    pending = resume.data_cursor["pending"]
    committed = {s.metadata["prompt_index"]
                 for rid in writer.committed_ids() for s in RolloutReader(rd).read(rid).samples}
    if "stopped in rollout" in log.read_text():  # mid-rollout: the stopped rollout's 4 groups, partial
        assert len(pending) == 4 and not {p["index"] for p in pending} & committed
        assert all(p["partial"] is not None and len(p["partial"]) == 2 for p in pending)
    else:  # rollouts shorter than the driver's poll: it stops between two (before the fix it never stopped)
        assert "stopped before rollout" in log.read_text() and not pending
