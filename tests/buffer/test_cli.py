from __future__ import annotations

import json

from typer.testing import CliRunner

from rlslurm.buffer import RolloutReader, RolloutWriter, TrainerProgress, after_checkpoint
from rlslurm.buffer.cli import app

from .helpers import make_meta, make_samples

runner = CliRunner()


def _fill(run, n=3):
    w = RolloutWriter(run)
    for rid in range(n):
        w.commit(rid, make_samples(rid), make_meta(rid))


def test_ls_json_and_table(run):
    _fill(run)
    r = RolloutReader(run)
    p = TrainerProgress()
    p.record_trained(r.read(0))
    after_checkpoint(r, p)
    res = runner.invoke(app, ["ls", str(run.path), "--json"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in res.stdout.splitlines()]
    assert [x["rollout_id"] for x in rows] == [0, 1, 2]
    assert [x["trained"] for x in rows] == [True, False, False]
    exp = make_samples(1)
    assert rows[1]["samples"] == 8 and rows[1]["truncation_rate"] == 2 / 8
    assert abs(rows[1]["reward_mean"] - sum(s.scalar_reward for s in exp) / 8) < 1e-12
    assert rows[1]["weight_versions"] == [0]
    res = runner.invoke(app, ["ls", str(run.path)])
    assert res.exit_code == 0 and "reward mean" in res.stdout and "25.0%" in res.stdout


def test_show_table_and_json(run):
    _fill(run)
    res = runner.invoke(app, ["show", str(run.path), "2"])
    assert res.exit_code == 0 and "label-2-0" in res.stdout and "truncated" in res.stdout
    res = runner.invoke(app, ["show", str(run.path), "2", "--json"])
    rows = [json.loads(x) for x in res.stdout.splitlines()]
    exp = make_samples(2)
    assert [x["response_tokens"] for x in rows] == [s.response_tokens.tolist() for s in exp]
    assert rows[1]["reward"] == exp[1].reward and rows[1]["reward_key"] == "acc"


def test_export_jsonl(run, tmp_path):
    _fill(run)
    out = tmp_path / "r1.jsonl"
    res = runner.invoke(app, ["export", str(run.path), "1", "--format", "jsonl", "--out", str(out)])
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    exp = make_samples(1)
    assert len(rows) == 8 and rows[0]["rollout_id"] == 1
    assert rows[0]["loss_mask"] == exp[0].effective_loss_mask().tolist()
    assert rows[2]["rollout_logprobs"] is None  # sample 2 has no logprobs
    assert rows[0]["rollout_logprobs"] == exp[0].rollout_logprobs.tolist()
    res = runner.invoke(app, ["export", str(run.path), "1"])
    assert res.stdout.encode() == out.read_bytes()


def test_clear_errors(run, tmp_path):
    _fill(run, 1)
    res = runner.invoke(app, ["show", str(run.path), "7"])
    assert res.exit_code == 1 and "00000007.manifest.json: rollout 7 is not committed" in res.output
    res = runner.invoke(app, ["export", str(run.path), "0", "--format", "parquet"])
    assert res.exit_code == 1 and "--format 'parquet'" in res.output
    res = runner.invoke(app, ["ls", str(tmp_path)])
    assert res.exit_code == 1 and f"{tmp_path}: not an rlslurm run directory" in res.output
    res = runner.invoke(app, ["ls", str(run.path), "--kind", "test"])
    assert res.exit_code == 1 and "--kind" in res.output
