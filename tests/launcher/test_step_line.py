"""The per-step line (rlslurm/step_line.py): what the trainer logs, `rlslurm run` prints and `rlslurm
status --follow` shows for every optimizer step, made from that step's metrics.jsonl record; and the
reader that gives `rlslurm run` and `status --follow` the records appended since it last looked."""

from __future__ import annotations

import json
from pathlib import Path

from rlslurm.step_line import MetricsTail, step_line

ROOT = Path(__file__).resolve().parents[2]
# A real record: step 2 of a THD run on an H100 (bench/results/thd-run-h100.md), written before the
# trainer's records carried the generation rate and the published version.
RECORD = json.loads((ROOT / "bench/results/thd-run-h100/thd-bf16-metrics.jsonl").read_text().splitlines()[2])


def test_a_record_makes_one_line_of_its_fields() -> None:
    line = step_line(RECORD)
    assert "\n" not in line
    assert line.startswith("rollout 1 step 2 | reward 0.272 | loss 5.03e-08 | ppo_kl 0 | grad 1.05 | ")
    assert "tok/s train 1574 | step 0.10 s" in line
    # what the record lacks is left out, not shown as 0
    assert "gen" not in line and "weights" not in line and "iteration" not in line


def test_the_generation_rate_the_version_and_its_transport() -> None:
    # RECORD with the fields today's trainer adds (rlslurm/trainer/main.py); the values are invented
    rec = {**RECORD, "kl": 0.00031, "rollout/tokens_per_s": 12345.6, "time/iteration": 2.06,
           "weight_sync/version": 2, "weight_sync/transport": "nccl"}
    line = step_line(rec)
    assert "| kl 0.00031 |" in line and "ppo_kl" not in line  # against the reference model, when there is one
    assert "| tok/s gen 12.3k train 1574 |" in line
    assert line.endswith("| step 0.10 s, iteration 2.1 s | weights v2 nccl")
    assert step_line({**rec, "loss": None, "grad_norm": float("nan")}).count("loss") == 0  # non-finite: left out


def test_the_tail_reads_whole_lines_once(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.new() == []  # no file yet
    path.write_text(json.dumps({"step": 0}) + "\n" + '{"step": 1')  # the second line is still being written
    assert tail.new() == [{"step": 0}]
    with open(path, "a") as f:
        f.write(', "loss": 1.0}\nnot json\n')  # a line torn by a crash is skipped, as metrics readers do
    assert tail.new() == [{"step": 1, "loss": 1.0}]
    assert tail.new() == []
    assert MetricsTail(path, from_end=True).new() == []  # `rlslurm run` resuming: only this attempt's lines
