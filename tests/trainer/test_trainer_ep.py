"""MoE expert parallelism in the RL trainer with dynamic batching (megatron-core on CPU, gloo), and
expert tensor parallelism apart from TP (ETP=1 at TP=2).

tiny-qwen3-moe at EP=2 x DP=2 (2 processes): the expert all-to-all spans both DP ranks, so both
must run the same number of micro-batches per optimizer step, and their micro-batches have
different padded shapes. The rollout's lengths are chosen so that, cut by the token budget, the
two ranks' natural micro-batch counts differ in step 0 (one rank splits a micro-batch) and in
step 1 one rank has fewer samples than the other's count (it runs a weight-zero filler). The
step must finish (bounded: a hang is killed and fails the test) and equal EP=1 x DP=1 on the same
batch: losses, metrics and updated weights.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from conftest import make_run

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

MODEL = "tiny-qwen3-moe"
BUDGET = 20  # --max-tokens-per-gpu
# Total tokens (prompt + response) per sample; steps of 5 samples: DP=2 splits each 3 + 2.
# step 0: rank 0 gets [12, 6] -> 2 micro-batches, rank 1 [6, 6, 2] -> 1 (3 x 6 <= 20): split to 2.
# step 1: rank 0 gets [14, 11, 10] -> 3 (no two fit together), rank 1 [13, 12] -> 2: one filler.
LENGTHS = [12, 6, 6, 6, 2, 14, 13, 12, 11, 10]
TRAIN = dict(entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.1, num_steps_per_rollout=2, global_batch_size=5,
             micro_batch_size=1, use_dynamic_batch_size=True, max_tokens_per_gpu=BUDGET, eps_clip=0.1, lr=3e-3,
             use_tis=True, tis_clip_low=0.2, tis_clip=2.0, adam_eps=1e-3)
COMPARED = ("loss", "pg_loss", "pg_clipfrac", "ppo_kl", "kl", "entropy", "grad_norm", "tokens", "tis", "tis_clipfrac",
            "train_rollout_logprob_abs_diff")


def _samples() -> list:
    from rlslurm.buffer import Sample

    rng = np.random.default_rng(11)
    out = []
    for i, n in enumerate(LENGTHS):
        p = n // 3 + 1
        r = n - p
        out.append(Sample(prompt_tokens=rng.integers(4, 64, p), response_tokens=rng.integers(4, 64, r),
                          reward=float(i % 3) + 0.25 * (i % 2),
                          rollout_logprobs=(-rng.random(r) * 3).astype(np.float32),
                          group_index=i // 5, index=i, weight_version=0))
    return out


def _prepare(tmp: Path, hf: Path, name: str, nproc: int, ep: int, megatron: dict | None = None,
             tp: int = 1, pp: int = 1, etp: int | None = None) -> Path:
    import yaml

    from rlslurm.buffer import RolloutMeta, RolloutWriter

    run = make_run(tmp / name, hf, nproc=nproc, rollout=dict(rollout_batch_size=2, n_samples_per_prompt=5),
                   train={**TRAIN, "expert_model_parallel_size": ep, "tensor_model_parallel_size": tp,
                          "pipeline_model_parallel_size": pp, "expert_tensor_parallel_size": etp,
                          "use_distributed_optimizer": nproc > tp * pp},
                   megatron=megatron)
    cfg = yaml.safe_load((run / "run.yaml").read_text())
    cfg["model"]["model"] = MODEL
    (run / "run.yaml").write_text(yaml.safe_dump(cfg))
    RolloutWriter(run).commit(0, _samples(), RolloutMeta(weight_versions=[0], data_cursor={"next": 1}))
    return run


def step_runs(request: pytest.FixtureRequest, tmp: Path) -> list[tuple]:
    """The runs (tests/trainer/conftest.py step_results: one torchrun per world size for the whole
    session): EP=1 on 1 process; EP=2 x DP=2 on 2; on 4, EP=2 with TP=2 or PP=2, DP=2, and TP=2 with
    experts whole (ETP=1) over EP=2. The run with an ETP of its own also checks a checkpoint resume
    (step_worker --resume-check)."""
    from rlslurm.settings.model_config import load_model_config
    from rlslurm.tiny import make_tiny_checkpoint

    hf = make_tiny_checkpoint(load_model_config(MODEL), tmp / "hf", seed=5)
    runs = [("ep1", 1, 1, 1, 1), ("ep2dp2", 2, 2, 1, 1), ("ep2tp2pp1", 4, 2, 2, 1), ("ep2tp1pp2", 4, 2, 1, 2),
            ("ep2tp2etp1", 4, 2, 2, 1, 1)]
    return [(name, nproc, _prepare(tmp, hf, name, nproc, ep, tp=tp, pp=pp, etp=etp[0] if etp else None),
             tmp / f"{name}-out", bool(etp)) for name, nproc, ep, tp, pp, *etp in runs]


@pytest.fixture(scope="module")
def layouts(step_results) -> dict[str, tuple[dict, dict]]:
    return step_results[__name__]


def _assert_equal_runs(ref: tuple[dict, dict], got: tuple[dict, dict]) -> None:
    (ra, rw), (ga, gw) = ref, got
    for a, b in zip(ra["steps"], ga["steps"], strict=True):
        for k in COMPARED:
            assert math.isfinite(a[k]), (k, a[k])
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (k, a[k], b[k])
    assert set(gw) == set(rw)
    assert any(".experts." in n for n in gw)  # the experts of both EP ranks reached the export
    worst = max(float((gw[n] - rw[n]).abs().max()) for n in gw)
    assert worst < 1e-5, worst


def test_lengths_make_unequal_natural_counts_and_need_a_filler() -> None:
    """The scenario is what the docstring says (so the EP run below really exercises both cases)."""
    from rlslurm.trainer.batching import balance, micro_batches, plan_batches

    natural = [[len(micro_batches(share, LENGTHS, micro_batch_size=1, max_tokens_per_gpu=BUDGET))
                for share in balance(list(range(5 * k, 5 * k + 5)), LENGTHS, 2)] for k in range(2)]
    assert natural == [[2, 1], [3, 2]]
    plans = [plan_batches(LENGTHS, num_steps=2, dp=2, dp_rank=r, micro_batch_size=1, max_tokens_per_gpu=BUDGET)
             for r in range(2)]
    assert [[p.num_microbatches(k) for k in range(2)] for p in plans] == [[2, 3], [2, 3]]
    assert [len(p.fillers[1]) for p in plans] == [0, 1] and not any(p.fillers[0] for p in plans)


def test_expert_parallel_dynamic_batches_equal_single_process(layouts) -> None:
    (ra, rw), (ga, gw) = layouts["ep1"], layouts["ep2dp2"]
    assert ga["dp"] == 2 and ra["dp"] == 1
    assert ga["logprob_max_abs_diff"] < 1e-5 and ra["logprob_max_abs_diff"] < 1e-5
    assert [s["num_microbatches"] for s in ga["steps"]] == [2.0, 3.0]  # rank 0: equalised counts
    assert ra["steps"][0]["grad_norm"] > 0 and abs(ra["steps"][1]["ppo_kl"]) > 1e-5
    _assert_equal_runs((ra, rw), (ga, gw))


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["ep2tp2", "ep2pp2"])
def test_expert_parallel_with_tensor_or_pipeline_parallel_equals_single_process(layouts, tp, pp) -> None:
    """EP=2 with TP=2 (sequence parallel) or PP=2, 4 processes, DP=2: the token all-to-all runs
    over the expert group while attention is split over TP or the layers over stages, and the
    export gathers over all of them; the same dynamic micro-batches as above. Equal to EP=1."""
    got = layouts[f"ep2tp{tp}pp{pp}"]
    assert (got[0]["dp"], got[0]["tp"], got[0]["pp"]) == (2, tp, pp)
    assert got[0]["logprob_max_abs_diff"] < 1e-5
    _assert_equal_runs(layouts["ep1"], got)


def test_expert_tensor_parallel_apart_from_tp_equals_single_process(layouts) -> None:
    """slime's MoE layout, experts whole on each rank (--expert-tensor-parallel-size 1) while attention
    is split over TP=2, EP=2: 4 processes, dense DP=2 and expert DP=2, the EP group now within a
    dense TP group (megatron-core's expert grid, rlslurm/settings/parallel_grid.py). Log-probs, losses and the
    published weights (gathered over ETP and EP) equal EP=1 on one process; a checkpoint saved and
    loaded at this layout takes the same step again, bit for bit."""
    got = layouts["ep2tp2etp1"]
    assert (got[0]["dp"], got[0]["tp"], got[0]["pp"]) == (2, 2, 1)
    assert got[0]["logprob_max_abs_diff"] < 1e-5
    _assert_equal_runs(layouts["ep1"], got)
    resume = got[0]["resume"]
    assert resume["expert_shards"] > 0 and resume["max_abs_diff"] == 0.0, resume
    assert {k: resume["first"][k] for k in COMPARED} == {k: resume["again"][k] for k in COMPARED}


def test_expert_parallel_uses_the_alltoall_dispatcher() -> None:
    """allgather gathers equal-sized chunks from ranks of different DP index, whose micro-batches
    differ in shape (it aborted on gloo): EP > 1 takes alltoall, and an allgather override is refused."""
    from rlslurm.errors import ConfigError
    from rlslurm.models import build as model_mod
    from rlslurm.settings.model_config import load_model_config

    mc = load_model_config(MODEL)
    assert model_mod.transformer_config(mc, ep=2).moe_token_dispatcher_type == "alltoall"
    with pytest.raises(ConfigError, match="--megatron-moe-token-dispatcher-type allgather at "
                                          "--expert-model-parallel-size 2"):
        model_mod.transformer_config(mc, ep=2, overrides={"moe_token_dispatcher_type": "allgather"})
    # experts split over more ranks than attention (ETP 2 > TP 1): that group spans DP ranks too
    assert model_mod.transformer_config(mc, tp=1, etp=2).moe_token_dispatcher_type == "alltoall"
    assert model_mod.transformer_config(mc, tp=2, etp=1).expert_tensor_parallel_size == 1
    with pytest.raises(ConfigError, match="--expert-tensor-parallel-size 2: it needs equal micro-batch"):
        model_mod.transformer_config(mc, tp=1, etp=2, overrides={"moe_token_dispatcher_type": "allgather"})
    with pytest.raises(ConfigError, match="^--megatron-expert-tensor-parallel-size: rlslurm sets it from "
                                          "--expert-tensor-parallel-size"):
        model_mod.transformer_config(mc, overrides={"expert_tensor_parallel_size": 1})
