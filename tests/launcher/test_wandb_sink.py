"""--use-wandb end to end below SLURM: a run directory made by `prepare_run_dir` with the key as a
secret, the trainer's MetricsLogger and the rollout driver's log_metrics fed real metric records
(a real prompt source, collector and filter; the trainer's rollout_metrics of committed rollouts),
and the real wandb package in offline mode. Read back from wandb's own files: the keys and steps,
a second attempt resuming the same run ids without repeating a step, and the key nowhere but in
control/secret_env."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("wandb")

from rlslurm.buffer.reader import RolloutReader  # noqa: E402
from rlslurm.buffer.sample import RolloutMeta, Sample, SampleStatus  # noqa: E402
from rlslurm.job.env import ATTEMPT_ENV  # noqa: E402
from rlslurm.metrics_sink import WandbSink  # noqa: E402
from rlslurm.resolve import resolve  # noqa: E402
from rlslurm.rollout.data import PromptSource  # noqa: E402
from rlslurm.rollout.driver import RolloutDriver, eval_metrics, generation_metrics, number_samples  # noqa: E402
from rlslurm.rollout.filters import GroupCollector, zero_std_filter  # noqa: E402
from rlslurm.settings.runfile import load_run_config  # noqa: E402
from rlslurm.slurm.submit import prepare_run_dir  # noqa: E402
from rlslurm.trainer.metrics import MetricsLogger, read_metrics  # noqa: E402
from tests.helpers.hf_shape import hf_shaped_dir  # noqa: E402
from tests.helpers.wandb_records import offline_runs  # noqa: E402

SECRET = "wandb-k3y-0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def wandb_env(tmp_path: Path, monkeypatch) -> Path:
    """wandb's own state (settings, cache, artifacts) in tmp, offline, and the key in the
    environment as the batch script's `. control/secret_env` would put it."""
    home = tmp_path / "wandb-home"
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(home / var.lower()))
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir-env"))  # must lose to RUN/wandb
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    return home


def _run_dir(tmp_path: Path, *extra: str, secret: bool = True):
    hf_shaped_dir(tmp_path / "hf", "tiny-qwen3")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"q{i}", "label": str(i % 3)}) + "\n" for i in range(64)))
    res = resolve(["--model", "tiny-qwen3", "--nodes", "2", "--device", "cpu", "--engines-per-node", "1",
                   "--trainer-procs-per-node", "1", "--run-name", "wb test", "--run-dir", str(tmp_path / "run"),
                   "--hf-checkpoint", str(tmp_path / "hf"), "--prompt-data", str(prompts),
                   "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--num-steps-per-rollout", "2",
                   "--global-batch-size", "8", "--micro-batch-size", "1", "--num-epoch", "10",
                   *(["--secret-env", "WANDB_API_KEY"] if secret else []), "--use-wandb", "--wandb-project", "rl-proj",
                   *extra])
    rd = prepare_run_dir(res)
    return load_run_config(rd.path), rd  # what the job reads: run.yaml


def _samples(prompt, rollout_id: int) -> list[Sample]:
    """A group as generate_group returns it: tokens, reward (a prompt-dependent rule, so some
    groups are all-right or all-wrong and the zero-std filter drops them), status."""
    out = []
    for k in range(4):
        n = 3 + (prompt.index + k) % 5
        right = int(prompt.label) == 0 or (int(prompt.label) == 1 and k % 2 == 0)
        out.append(Sample(prompt_tokens=np.arange(4), response_tokens=np.arange(n), reward=float(right),
                          rollout_logprobs=np.full(n, -0.5, dtype=np.float32), weight_version=rollout_id,
                          status=SampleStatus.TRUNCATED if n == 7 else SampleStatus.COMPLETED, label=prompt.label))
    return out


def _driver_rollout(driver: RolloutDriver, rollout_id: int) -> list[Sample]:
    """What RolloutDriver.generate_rollout does around the engines: collect with a filter, commit,
    log the train record; and an eval record (pass@k) at the same rollout id."""
    src = driver.source

    async def run_group(prompt):
        return _samples(prompt, rollout_id)

    collected = asyncio.run(GroupCollector(src, run_group, rollout_batch_size=4, filters=[zero_std_filter]).collect())
    samples = number_samples(collected.groups, collected.prompts)
    driver.writer.commit(rollout_id, samples, RolloutMeta(kind="train", data_cursor=src.state_dict()))
    eval_src = PromptSource(driver.cfg.data.prompt_data, shuffle=False)
    eval_groups = [_samples(p, rollout_id) for p in eval_src.take(6)]
    driver.log_metrics(rollout_id, "eval", eval_metrics("held", eval_groups, 4))
    driver.log_metrics(rollout_id, "train", {**collected.metrics, **generation_metrics(samples, 0.5)})
    return samples


def _train(logger: MetricsLogger, run: Path, rollout_id: int) -> None:
    """The trainer's records of one rollout (trainer/main.py `_train_rollout`): data metrics from
    the committed rollout, one line per optimizer step."""
    from rlslurm.trainer.step import rollout_metrics

    rollout = RolloutReader(run, readonly=True).read(rollout_id)
    data = rollout_metrics(rollout, [s.scalar_reward for s in rollout.samples])
    for k in range(2):
        logger.log(rollout_id * 2 + k, {"rollout_id": rollout_id, "loss": 0.5 - 0.1 * rollout_id - 0.01 * k,
                                        "grad_norm": 1.0 + k, **data, "time/wait_rollout": 0.1})


def _attempt(cfg, rd, attempt: int, monkeypatch, train: range, generate: range) -> None:
    monkeypatch.setenv(ATTEMPT_ENV, str(attempt))
    driver = RolloutDriver(cfg, rd, router_url="http://127.0.0.1:9", engine_urls=lambda: [], api_key=None,
                           tokenizer=None)
    resume = driver.writer.resume_point()
    if resume.data_cursor:
        driver.source.load_state_dict(resume.data_cursor)
    for rid in generate:
        _driver_rollout(driver, rid)
    driver.close_metrics()
    logger = MetricsLogger(rd.metrics, None, enabled=True, attempt=attempt, cfg=cfg)
    assert "WandbSink" in logger.sinks.names()
    for rid in train:
        _train(logger, rd.path, rid)
    logger.close()


def test_offline_runs_have_the_keys_and_steps_and_a_requeue_resumes_them(tmp_path, wandb_env, monkeypatch):
    cfg, rd = _run_dir(tmp_path)
    base = cfg.run.wandb_run_id
    assert base and base.startswith("wb-test-")  # derived at submit, kept in run.yaml
    _attempt(cfg, rd, 0, monkeypatch, train=range(0, 3), generate=range(0, 3))
    # wandb names an offline run's directory by its start second: attempts are minutes apart on a
    # cluster; here they must not share a second
    time.sleep(1.1)
    # attempt 1: the trainer resumes from a checkpoint after rollout 0 and trains 1 and 2 again
    _attempt(load_run_config(rd.path), rd, 1, monkeypatch, train=range(1, 4), generate=range(3, 5))

    files = rd.path / "wandb"
    trainer = offline_runs(files, f"{base}-trainer")
    rollout = offline_runs(files, f"{base}-rollout")
    assert len(trainer) == 2 and len(rollout) == 2  # one offline run per attempt, the same id
    assert not (tmp_path / "wandb-dir-env").exists()  # --wandb-dir's default, RUN/wandb, wins over WANDB_DIR
    for r in trainer + rollout:
        assert r.project == "rl-proj" and r.group == "wb test"
        assert r.config["run"]["wandb_run_id"] == base  # the run config, from run.yaml
    assert [r.name for r in trainer] == ["wb test-trainer"] * 2 and [r.name for r in rollout] == ["wb test-rollout"] * 2

    # the W&B step is the rollout id; a resumed attempt skips what the earlier one logged, so
    # `wandb sync --append` can join them
    assert trainer[0].steps == [0, 1, 2] and trainer[1].steps == [3]
    assert rollout[0].steps == [0, 1, 2] and rollout[1].steps == [3, 4]
    row = trainer[0].history[1]
    assert row["rollout_id"] == 1 and row["attempt"] == 0
    assert row["loss"] == pytest.approx(0.39)  # two optimizer steps, one rollout: the last step's values
    for key in ("grad_norm", "reward_mean", "reward_std", "response_length_mean", "truncation_rate",
                "time/wait_rollout"):
        assert key in row, key
    assert trainer[1].history[0]["attempt"] == 1
    r0 = rollout[0].history[0]  # eval and train records of rollout 0 in one row
    for key in ("rollout/reward_mean", "rollout/response_len_mean", "rollout/truncated_rate",
                "rollout/filter/groups_dropped", "rollout/filter/keep_rate", "eval/held/pass@4",
                "eval/held/reward_mean"):
        assert key in r0, key
    assert any(k.startswith("rollout/filter/drop_zero_std_") for k in r0)
    assert "time" not in r0 and "kind" not in r0  # bookkeeping stays in the JSONL files

    # TensorBoard: the rollout's scalars in RUN/tb/rollout at the rollout id, both attempts
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(rd.tb_dir / "rollout"))
    tb.Reload()
    assert [e.step for e in tb.Scalars("rollout/reward_mean")] == [0, 1, 2, 3, 4]
    assert [e.step for e in tb.Scalars("eval/held/pass@4")] == [0, 1, 2, 3, 4]
    assert "time" not in tb.Tags()["scalars"]

    # the JSONL files are the record: every attempt's lines, steps 2..5 (rollouts 1, 2) twice
    lines = read_metrics(rd.metrics)
    assert [(x["attempt"], x["step"]) for x in lines] == [(0, s) for s in range(6)] + [(1, s) for s in range(2, 8)]
    kinds = [(x["kind"], x["rollout_id"]) for x in read_metrics(rd.path / "rollout_metrics.jsonl")]
    assert kinds == [(k, r) for r in range(5) for k in ("eval", "train")]

    # the key: in control/secret_env (0600) and nowhere else under the run directory
    secret_file = rd.control_dir / "secret_env"
    assert SECRET in secret_file.read_text()
    assert SECRET not in rd.run_yaml.read_text()
    checked = 0
    for f in rd.path.rglob("*"):
        if f.is_file() and f != secret_file:
            assert SECRET.encode() not in f.read_bytes(), f
            checked += 1
    assert checked > 20 and any(f.name == "debug.log" for f in files.rglob("*"))  # wandb's own logs included


def test_a_wandb_that_cannot_start_leaves_the_jsonl_record(tmp_path, wandb_env, monkeypatch, caplog):
    """Online with no key (and no ~/.netrc in a tmp HOME): wandb refuses to start; training goes on
    with metrics.jsonl, and the error is one line in the log."""
    monkeypatch.delenv("WANDB_API_KEY")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_MODE", "online")
    cfg, rd = _run_dir(tmp_path, "--wandb-mode", "online", "--wandb-host", "http://127.0.0.1:9", secret=False)
    t0 = time.monotonic()
    logger = MetricsLogger(rd.metrics, None, enabled=True, attempt=0, cfg=cfg)
    assert logger.sinks.names() == ["JsonlSink"] and time.monotonic() - t0 < 60
    logger.log(0, {"rollout_id": 0, "loss": 1.0})
    logger.close()
    assert [x["loss"] for x in read_metrics(rd.metrics)] == [1.0]
    errors = [r.getMessage() for r in caplog.records if r.name == "rlslurm.metrics_sink"]
    assert len(errors) == 1 and errors[0].startswith(f"W&B: could not start run {cfg.run.wandb_run_id}-trainer")
    assert "\n" not in errors[0]


def test_disabled_mode_starts_no_wandb(tmp_path, wandb_env, monkeypatch):
    cfg, rd = _run_dir(tmp_path, "--wandb-mode", "disabled")
    logger = MetricsLogger(rd.metrics, None, enabled=True, attempt=0, cfg=cfg)
    assert logger.sinks.names() == ["JsonlSink"]
    logger.close()
    assert not (rd.path / "wandb").exists()


def test_a_regenerated_rollout_is_not_logged_twice(tmp_path, wandb_env):
    """The driver regenerates a quarantined (older) rollout: W&B steps must grow, so it is skipped."""
    cfg, rd = _run_dir(tmp_path)
    sink = WandbSink.open(cfg, "rollout", attempt=0)
    assert sink is not None
    for rid in (0, 1, 2, 1, 2, 3):
        sink.log({"rollout_id": rid, "kind": "train", "rollout/reward_mean": float(rid)}, step=rid, rollout_id=rid)
    sink.close()
    (run,) = offline_runs(rd.path / "wandb", f"{cfg.run.wandb_run_id}-rollout")
    assert run.steps == [0, 1, 2, 3]
    assert (rd.path / "wandb" / "rollout.last_step").read_text() == "3"
