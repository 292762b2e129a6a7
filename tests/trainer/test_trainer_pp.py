"""Pipeline parallelism in the RL step (megatron-core on CPU, gloo): one rollout through megatron's
1F1B schedule at PP=2 (and TP=2 x PP=2) gives the losses, metrics and updated weights of PP=1 on
the same batch, for a dense model and for an MLA + MoE model whose stages differ (dense first
layer, MoE second), and the log-probs of the pipelined forward equal HF transformers'."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import HERE, commit_rollouts, make_run, torchrun

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

# Every loss term on (entropy bonus, KL to the reference, TIS), two optimizer steps with two and
# three micro-batches of unequal padded lengths (dynamic batching): the schedule must carry
# activations of different shapes between the stages. A large Adam eps keeps the update linear in
# tiny gradients (see test_trainer_step.py).
TRAIN = dict(entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.1, num_steps_per_rollout=2, global_batch_size=4,
             micro_batch_size=1, use_dynamic_batch_size=True, max_tokens_per_gpu=20, eps_clip=0.1, lr=3e-3,
             use_tis=True, tis_clip_low=0.2, tis_clip=2.0, adam_eps=1e-3)
COMPARED = ("loss", "pg_loss", "pg_clipfrac", "ppo_kl", "kl", "entropy", "grad_norm", "tokens", "tis", "tis_clipfrac",
            "train_rollout_logprob_abs_diff", "num_microbatches")


def _run(tmp: Path, hf: Path, name: str, nproc: int, tp: int, pp: int, model: str | None = None
         ) -> tuple[dict, dict]:
    run = make_run(tmp / name, hf, nproc=nproc,
                   train={**TRAIN, "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp})
    if model is not None:
        import yaml

        cfg = yaml.safe_load((run / "run.yaml").read_text())
        cfg["model"]["model"] = model
        (run / "run.yaml").write_text(yaml.safe_dump(cfg))
    commit_rollouts(run, range(1))
    out = tmp / f"{name}-out"
    p = torchrun([str(HERE / "step_worker.py"), "--run-dir", str(run), "--out", str(out)], nproc, timeout=400)
    assert p.returncode == 0, p.stderr[-6000:]
    return json.loads((out / "result.json").read_text()), torch.load(out / "weights.pt")


def _same(ref: tuple[dict, dict], got: tuple[dict, dict], what: str) -> None:
    (ra, rw), (ga, gw) = ref, got
    assert len(ra["steps"]) == len(ga["steps"]) == 2
    for a, b in zip(ra["steps"], ga["steps"]):
        for k in COMPARED:
            assert math.isfinite(a[k]), (what, k, a[k])
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (what, k, a[k], b[k])
    assert set(gw) == set(rw)
    worst = max(float((gw[n] - rw[n]).abs().max()) for n in gw)
    assert worst < 1e-5, (what, worst)


@pytest.fixture(scope="module")
def dense(tmp_path_factory, tiny_hf) -> dict[str, tuple[dict, dict]]:
    tmp = tmp_path_factory.mktemp("pp")
    return {name: _run(tmp, tiny_hf, name, nproc, tp, pp)
            for name, nproc, tp, pp in (("pp1", 1, 1, 1), ("pp2", 2, 1, 2), ("tp2pp2", 4, 2, 2))}


def test_pipelined_logprobs_match_hf_transformers(dense) -> None:
    for name in ("pp2", "tp2pp2"):
        res, _ = dense[name]
        assert res["pp"] == 2
        assert res["logprob_scale"] > 1.0
        assert res["logprob_max_abs_diff"] < 1e-5, (name, res)
        assert res["entropy_max_abs_diff"] < 1e-5, (name, res)


@pytest.mark.parametrize("name", ["pp2", "tp2pp2"])
def test_pipeline_equals_single_stage(dense, name: str) -> None:
    ref, _ = dense["pp1"]
    # the batch really was cut into unequal micro-batches, and the update did something
    assert [s["num_microbatches"] for s in ref["steps"]] != [1.0, 1.0]
    assert ref["steps"][0]["grad_norm"] > 0 and abs(ref["steps"][1]["ppo_kl"]) > 1e-5
    _same(dense["pp1"], dense[name], name)


def test_mla_moe_pipeline_equals_single_stage(tmp_path_factory) -> None:
    """tiny-deepseek-v3: MLA attention, a dense first layer (stage 0) and an MoE second layer with
    a shared expert and router expert bias (stage 1)."""
    from rlslurm.model_config import load_model_config
    from rlslurm.tiny import make_tiny_checkpoint

    tmp = tmp_path_factory.mktemp("pp-mla-moe")
    hf = make_tiny_checkpoint(load_model_config("tiny-deepseek-v3"), tmp / "hf", seed=5)
    ref = _run(tmp, hf, "pp1", 1, 1, 1, model="tiny-deepseek-v3")
    got = _run(tmp, hf, "pp2", 2, 1, 2, model="tiny-deepseek-v3")
    assert got[0]["logprob_max_abs_diff"] < 1e-5, got[0]
    _same(ref, got, "tiny-deepseek-v3 pp2")
