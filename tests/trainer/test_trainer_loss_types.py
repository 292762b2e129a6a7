"""--loss-type sft_loss and custom_loss, and --custom-advantage-function-path, through the trainer's
real path (megatron-core on CPU): a custom loss that is the SFT loss trains exactly as sft_loss."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import commit_rollouts, make_run

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

PLUGIN = '''
import torch

def nll(inputs):
    loss = -inputs.reduce(inputs.log_probs)
    return loss, {"loss": loss.detach(), "adv_mean": inputs.reduce(inputs.advantages)}

nll.metric_keys = ("adv_mean",)

def ones(inputs):
    a = [torch.ones_like(m) for m in inputs.loss_masks]
    return a, a
'''


def _prepare(tmp: Path, hf: Path, name: str, train: dict) -> tuple[Path, Path]:
    run = make_run(tmp / name, hf, train={"lr": 3e-3, "adam_eps": 1e-3, **train})
    commit_rollouts(run, range(1))
    return run, tmp / f"{name}-out"


def step_runs(request: pytest.FixtureRequest, tmp: Path) -> list[tuple]:
    """Both runs (tests/trainer/conftest.py step_results: in the session's one-process torchrun, in
    turn, each from a fresh parallel state)."""
    hf = request.getfixturevalue("tiny_hf")
    plugin = tmp / "plugin.py"
    plugin.write_text(PLUGIN)
    return [(name, 1, *_prepare(tmp, hf, name, train), False) for name, train in (
        ("sft", {"loss_type": "sft_loss"}),
        ("custom", {"loss_type": "custom_loss", "custom_loss_function_path": f"{plugin}:nll",
                    "custom_advantage_function_path": f"{plugin}:ones"}))]


def test_custom_loss_equal_to_sft_trains_exactly_as_sft_loss(step_results) -> None:
    (sft, w_sft), (custom, w_custom) = (step_results[__name__][k] for k in ("sft", "custom"))
    for a, b in zip(sft["steps"], custom["steps"]):
        assert "pg_loss" not in a and "pg_loss" not in b
        assert math.isfinite(a["loss"]) and a["loss"] > 0  # a mean negative log-likelihood
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
        assert b["adv_mean"] == pytest.approx(1.0)  # the custom advantages reached the loss
    assert sft["steps"][1]["loss"] < sft["steps"][0]["loss"]  # the NLL of the trained responses fell
    assert all(torch.equal(w_sft[n], w_custom[n]) for n in w_sft)
