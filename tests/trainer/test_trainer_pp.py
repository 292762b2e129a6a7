"""Pipeline parallelism in the RL trainer (megatron-core on CPU, gloo).

- One rollout through megatron's 1F1B schedule at PP=2, TP=2 x PP=2, DP=2 x PP=2 (distributed
  optimizer) and PP=4 gives the losses, metrics and updated weights of PP=1 on the same batch: a
  dense 5-layer model with tied embeddings (the first stage's embedding and the last stage's output
  layer are one weight, its gradient summed across stages), its layers split unevenly over the
  stages (--decoder-first/last-pipeline-num-layers: 2+3, 3+2, 1+4, 1+1+1+2; the PP=4 run also
  resumes a step from a checkpoint at that split, bit for bit) and, at TP=2 x PP=2 (sequence
  parallel), an MLA + MoE model whose stages differ (dense first layer, MoE second), split evenly;
  the pipelined forward's log-probs equal HF transformers'.
- Context parallelism (CP=2, docs/context-parallel.md): packed at CP=2 (resuming its last step from
  PP=1's checkpoint), padded at CP=2 x PP=2, the MLA + MoE model and GLM-5's sparse attention at CP=2,
  and Qwen3-Next's gated delta nets at CP=2 x PP=2 give PP=1's losses, metrics and updated weights; so
  does GLM-5.2's shared top-k at PP=2 with full recompute.
- PPO (critic, reference, KL) through the entry point at PP=2 takes finite steps, and a kill -9
  + resume from the stage-sharded checkpoint is bit-exact.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

# at import time: `conftest` in sys.modules is the last one pytest loaded (another directory's) by test time
from conftest import MODEL, commit_rollouts, kill_tree, make_run, metrics, run_trainer, start_trainer

from rlslurm.settings.model_config import MODEL_CONFIG_DIR

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

# Every loss term on (entropy bonus, KL to the reference, TIS), two optimizer steps with two and
# three micro-batches of unequal padded lengths (dynamic batching): the schedule must carry
# activations of different shapes between the stages. A large Adam eps keeps the update linear in
# tiny gradients (see test_trainer_step.py).
TRAIN = dict(entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.1, num_steps_per_rollout=2, global_batch_size=4,
             micro_batch_size=1, use_dynamic_batch_size=True, max_tokens_per_gpu=20, eps_clip=0.1, lr=3e-3,
             use_tis=True, tis_clip_low=0.2, tis_clip=2.0, adam_eps=1e-3)
COMPARED = ("loss", "pg_loss", "pg_clipfrac", "ppo_kl", "kl", "entropy", "grad_norm", "tokens", "tis", "tis_clipfrac",
            "train_rollout_logprob_abs_diff")


def _prepare(tmp: Path, hf: Path, name: str, nproc: int, tp: int, pp: int, model: str | None = None,
             dist_opt: bool = False, stages: tuple[int | None, int | None] = (None, None),
             extra: dict | None = None) -> Path:
    run = make_run(tmp / name, hf, nproc=nproc,
                   train={**TRAIN, "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                          "use_distributed_optimizer": dist_opt, "decoder_first_pipeline_num_layers": stages[0],
                          "decoder_last_pipeline_num_layers": stages[1], **(extra or {})})
    if model is not None:
        import yaml

        cfg = yaml.safe_load((run / "run.yaml").read_text())
        cfg["model"]["model"] = model
        (run / "run.yaml").write_text(yaml.safe_dump(cfg))
    commit_rollouts(run, range(1))
    return run


def _same(ref: tuple[dict, dict], got: tuple[dict, dict], what: str) -> None:
    (ra, rw), (ga, gw) = ref, got
    assert len(ra["steps"]) == len(ga["steps"]) == 2
    for a, b in zip(ra["steps"], ga["steps"]):
        for k in COMPARED:
            assert math.isfinite(a[k]), (what, k, a[k])
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (what, k, a[k], b[k])
        if ra["dp"] == ga["dp"] and ra["cp"] == ga["cp"]:  # per DP rank: the same cut into micro-batches
            # (context parallelism: a micro-batch may hold --max-tokens-per-gpu x CP tokens)
            assert a["num_microbatches"] == b["num_microbatches"], what
    assert set(gw) == set(rw)
    worst = max(float((gw[n] - rw[n]).abs().max()) for n in gw)
    assert worst < 1e-5, (what, worst)


def step_runs(request: pytest.FixtureRequest, tmp: Path) -> list[tuple]:
    """Every step_worker run of this module, "<model>/<layout>" (tests/trainer/conftest.py step_results:
    one torchrun per world size, 1, 2 and 4 processes, for the whole session).

    dense: tiny-qwen3 with tied embeddings (a model config file of our own; qwen3-4B is tied too) and 5
    layers, which no PP > 1 divides: every dense pipeline is split by the first/last-stage counts
    (rlslurm/settings/parallel_grid.py stage_layers), each stage's layers numbered from its own offset.
    dp2pp2: the distributed optimizer (the default whenever DP > 1) shards the state over DP inside
    each stage; its grad norm and clipping still span both stages. pp4: both counts and two stages
    between them, and a checkpoint saved and loaded at that split (step_worker --resume-check).
    mla: tiny-deepseek-v3, MLA attention, a dense first layer (stage 0) and an MoE second layer with a
    shared expert and router expert bias (stage 1)."""
    import yaml

    from rlslurm.settings.model_config import load_model_config
    from rlslurm.tiny import make_tiny_checkpoint

    raw = yaml.safe_load((MODEL_CONFIG_DIR / f"{MODEL}.yaml").read_text())
    raw["name"] = f"{MODEL}-tied"
    raw["arch"]["tie_word_embeddings"] = True
    raw["arch"]["num_layers"] = 5
    tied = tmp / f"{MODEL}-tied.yaml"
    tied.write_text(yaml.safe_dump(raw))
    hf = make_tiny_checkpoint(load_model_config(str(tied)), tmp / "hf", seed=3)
    mla_tmp = tmp / "mla-moe"
    mla_hf = make_tiny_checkpoint(load_model_config("tiny-deepseek-v3"), mla_tmp / "hf", seed=5)
    next_tmp = tmp / "qwen3-next"
    next_hf = make_tiny_checkpoint(load_model_config("tiny-qwen3-next"), next_tmp / "hf", seed=5)
    d, m = (tmp, hf, str(tied)), (mla_tmp, mla_hf, "tiny-deepseek-v3")
    q = (next_tmp, next_hf, "tiny-qwen3-next")
    # key: (dir, hf, model), nproc, tp, pp, distributed optimizer, (first, last stage's layers)[, train extra]
    cp2, packed = {"context_parallel_size": 2}, {"qkv_format": "thd"}
    specs = {"dense/pp1": (d, 1, 1, 1, False, (None, None)), "dense/pp2": (d, 2, 1, 2, False, (2, None)),
             "dense/tp2pp2": (d, 4, 2, 2, False, (None, 2)), "dense/dp2pp2": (d, 4, 1, 2, True, (1, 4)),
             "dense/pp4": (d, 4, 1, 4, False, (1, 2)),
             "mla/pp1": (m, 1, 1, 1, False, (None, None)), "mla/tp2pp2": (m, 4, 2, 2, False, (None, None)),
             # context parallelism (docs/context-parallel.md)
             "dense/cp2-thd": (d, 2, 1, 1, False, (None, None), {**cp2, **packed}),
             "dense/cp2pp2": (d, 4, 1, 2, False, (2, None), cp2),
             "mla/cp2": (m, 2, 1, 1, False, (None, None), cp2),
             # Qwen3-Next's gated delta nets: rlslurm's CP (the mixing over the whole sequence) and a
             # pipeline whose second stage starts at a gated delta net (layer 1 of 0-2)
             "next/pp1": (q, 1, 1, 1, False, (None, None)),
             "next/cp2pp2": (q, 4, 1, 2, False, (1, None), cp2)}
    runs = []
    for key, ((where, h, model), n, tp, pp, do, stages, *extra) in specs.items():
        name = key.split("/")[1]
        run = _prepare(where, h, name, n, tp, pp, model=model, dist_opt=do, stages=stages, extra=(extra or [None])[0])
        # dense/pp1 checkpoints before its last step (--resume-check), dense/cp2-thd takes its last step
        # from that checkpoint: a resume at CP 2 from a CP 1 checkpoint (1 process runs before 2)
        runs.append((key, n, run, where / f"{name}-out", key in ("dense/pp4", "dense/pp1"),
                     d[0] / "pp1" / "checkpoints" if key == "dense/cp2-thd" else None))
    # GLM-5 (tiny-glm-moe-dsa: indexers in layers 0 and 1, layer 2 reuses layer 1's top-k): sparse
    # attention at CP 2, each rank's queries against every rank's indexer keys and top-k keys; and, with a
    # 4th layer (indexer), at PP 2 (stages [0, 1, 2], [3]) with full recompute, where the first stage's
    # 1F1B warm-up runs other micro-batches' forwards before a micro-batch's backward recomputes the shared
    # layer (rlslurm/models/dsa.py SharedTopKAttention); each against the same model on one rank
    import yaml

    g_tmp = tmp / "glm5"
    g_raw = yaml.safe_load((MODEL_CONFIG_DIR / "tiny-glm-moe-dsa.yaml").read_text())
    g_raw["name"], g_raw["arch"]["num_layers"] = "tiny-glm-moe-dsa-4", 4
    g4 = g_tmp / "tiny-glm-moe-dsa-4.yaml"
    g_tmp.mkdir(parents=True, exist_ok=True)
    g4.write_text(yaml.safe_dump(g_raw))
    hfs = {"tiny-glm-moe-dsa": make_tiny_checkpoint(load_model_config("tiny-glm-moe-dsa"), g_tmp / "hf", seed=5),
           str(g4): make_tiny_checkpoint(load_model_config(str(g4)), g_tmp / "hf4", seed=5)}
    for name, model, n, pp, extra in (("pp1", "tiny-glm-moe-dsa", 1, 1, None), ("cp2", "tiny-glm-moe-dsa", 2, 1, cp2),
                                      ("pp1-4", str(g4), 1, 1, None),
                                      ("pp2-recompute", str(g4), 2, 2, {"decoder_first_pipeline_num_layers": 3})):
        run = _prepare(g_tmp, hfs[model], name, n, 1, pp, model=model, extra=extra)
        if name == "pp2-recompute":
            cfg = yaml.safe_load((run / "run.yaml").read_text())
            cfg["megatron"] = {"recompute_granularity": "full", "recompute_method": "uniform",
                               "recompute_num_layers": 1}
            (run / "run.yaml").write_text(yaml.safe_dump(cfg))
        runs.append((f"glm5/{name}", n, run, g_tmp / f"{name}-out", name == "cp2", None))
    return runs


@pytest.fixture(scope="module")
def layouts(step_results) -> dict[str, tuple[dict, dict]]:
    return step_results[__name__]


@pytest.fixture(scope="module")
def dense(layouts) -> dict[str, tuple[dict, dict]]:
    return {k.split("/")[1]: v for k, v in layouts.items() if k.startswith("dense/")}


def test_pipelined_logprobs_match_hf_transformers(dense) -> None:
    for name in ("pp2", "tp2pp2", "dp2pp2", "pp4"):
        res, _ = dense[name]
        assert res["pp"] == (4 if name == "pp4" else 2)
        assert res["logprob_scale"] > 1.0
        assert res["logprob_max_abs_diff"] < 1e-5, (name, res)
        assert res["entropy_max_abs_diff"] < 1e-5, (name, res)


@pytest.mark.parametrize("name", ["pp2", "tp2pp2", "dp2pp2", "pp4"])
def test_pipeline_equals_single_stage(dense, name: str) -> None:
    ref, _ = dense["pp1"]
    # the batch really was cut into unequal micro-batches, and the update did something
    assert [s["num_microbatches"] for s in ref["steps"]] != [1.0, 1.0]
    assert ref["steps"][0]["grad_norm"] > 0 and abs(ref["steps"][1]["ppo_kl"]) > 1e-5
    assert "lm_head.weight" not in dense[name][1]  # tied: exported once, as the embedding
    _same(dense["pp1"], dense[name], name)
    assert len([n for n in dense[name][1] if n.endswith(".self_attn.o_proj.weight")]) == 5  # every layer, once


@pytest.mark.parametrize("name", ["cp2-thd", "cp2pp2"])
def test_context_parallel_equals_one_rank(dense, name: str) -> None:
    """CP=2 (each sequence in 2 x CP chunks over two ranks, keys and values all-gathered in rlslurm's
    core attention), packed and padded x PP=2, gives the losses, metrics, grad norm and updated weights
    of PP=1 on the same batch; CP 2 packed took its last step from dense/pp1's CP 1 checkpoint (its own
    state perturbed first: step_worker --resume-from), so the checkpoint re-shards from CP 1 to CP 2."""
    res, _ = dense[name]
    assert res["cp"] == 2 and res["pp"] == (2 if name == "cp2pp2" else 1)
    assert res["logprob_max_abs_diff"] < 1e-5 and res["entropy_max_abs_diff"] < 1e-5, res
    _same(dense["pp1"], dense[name], name)
    if name == "cp2-thd":
        assert res["resumed_from"].endswith("pp1/checkpoints/iter_0000000"), res["resumed_from"]


def test_context_parallel_mla_moe_equals_one_rank(layouts) -> None:
    """tiny-deepseek-v3 (MLA attention, an MoE layer with a shared expert) at CP=2 equals PP=1."""
    ref, got = layouts["mla/pp1"], layouts["mla/cp2"]
    assert got[0]["cp"] == 2 and got[0]["logprob_max_abs_diff"] < 1e-5, got[0]
    _same(ref, got, "tiny-deepseek-v3 cp2")


def test_context_parallel_gated_delta_nets_equal_one_rank(layouts) -> None:
    """tiny-qwen3-next at CP=2 x PP=2 (stage 1 = layers 1-2: a gated delta net, then gated attention)
    equals PP=1: megatron-core 0.16's GatedDeltaNet has no CP; rlslurm's subclass all-gathers the
    in_proj output over CP and mixes the whole sequence (models/gated_delta.py)."""
    ref, got = layouts["next/pp1"], layouts["next/cp2pp2"]
    assert (got[0]["cp"], got[0]["pp"]) == (2, 2) and got[0]["logprob_max_abs_diff"] < 1e-5, got[0]
    assert ref[0]["logprob_max_abs_diff"] < 1e-5, ref[0]
    _same(ref, got, "tiny-qwen3-next cp2pp2")


def test_context_parallel_glm5_sparse_attention_equals_one_rank(layouts) -> None:
    """GLM-5 (MLA + MoE + sparse attention keeping 4 keys per query, one layer reusing another's; the
    rows here are up to 13 tokens) at CP=2: log-probs equal HF transformers', and losses, metrics and
    updated weights equal one rank's (megatron-core 0.16's DSA asserts CP 1; rlslurm's GLM-5 attention
    gathers the indexer keys and the keys/values over CP itself); its checkpoint resumes bit for bit."""
    ref, got = layouts["glm5/pp1"], layouts["glm5/cp2"]
    assert got[0]["cp"] == 2 and ref[0]["logprob_max_abs_diff"] < 1e-5 and got[0]["logprob_max_abs_diff"] < 1e-5
    _same(ref, got, "tiny-glm-moe-dsa cp2")
    # and a checkpoint saved there (the frozen indexers in the model, not in the optimizer) resumes bit for bit
    assert got[0]["resume"]["max_abs_diff"] == 0.0, got[0]["resume"]


def test_glm52_shared_top_k_under_pipeline_and_full_recompute_equals_one_rank(layouts) -> None:
    """GLM-5.2's shared layer in the first of 2 stages, every layer recomputed in the backward: the
    recompute takes the top-k its micro-batch's forward used, not the last one seen (with the latter,
    measured: 'no top-k of layer 2 for this micro-batch'); the same steps as one rank."""
    ref, got = layouts["glm5/pp1-4"], layouts["glm5/pp2-recompute"]
    assert got[0]["pp"] == 2 and got[0]["logprob_max_abs_diff"] < 1e-5
    assert [s["num_microbatches"] for s in ref[0]["steps"]] != [1.0, 1.0]  # 1F1B has a warm-up to get wrong
    _same(ref, got, "tiny-glm-moe-dsa pp2 full recompute")


def test_checkpoint_resumes_at_an_uneven_split(dense) -> None:
    """PP=4 at 1+1+1+2 layers: dist_checkpointing saved each stage's layers under their global numbers
    and loaded them back there (step_worker._resume_check perturbs the parameters in between): the
    step taken again from the checkpoint is the first one, bit for bit."""
    resume = dense["pp4"][0]["resume"]
    assert resume["max_abs_diff"] == 0.0, resume
    assert {k: resume["first"][k] for k in COMPARED} == {k: resume["again"][k] for k in COMPARED}


def test_mla_moe_pipeline_equals_single_stage(layouts) -> None:
    """tiny-deepseek-v3 at TP=2 x PP=2: MLA attention, a dense first layer (stage 0) and an MoE
    second layer with a shared expert and router expert bias (stage 1); TP > 1 turns on sequence
    parallelism, so micro-batches are padded to a multiple of TP."""
    ref, got = layouts["mla/pp1"], layouts["mla/tp2pp2"]
    assert got[0]["logprob_max_abs_diff"] < 1e-5, got[0]
    _same(ref, got, "tiny-deepseek-v3 tp2pp2")


# PPO through the entry point at PP=2: a critic (critic-only warm-up on rollout 0), a frozen
# reference for the KL loss, GAE advantages from the critic's values, and dynamic micro-batches.
PPO = dict(advantage_estimator="ppo", num_critic_only_steps=1, critic_lr=2e-3, normalize_advantages=True, gamma=1.0,
           lambd=0.95, use_kl_loss=True, kl_loss_coef=0.05, entropy_coef=0.01, pipeline_model_parallel_size=2,
           num_steps_per_rollout=2, global_batch_size=4, micro_batch_size=1, use_dynamic_batch_size=True,
           max_tokens_per_gpu=20, save_interval=1, keep_checkpoints=2, weight_sync="disk")


def test_ppo_kill_and_resume_at_pp2_is_bit_exact(tmp_path: Path, tiny_hf: Path) -> None:
    """3 rollouts straight == 2 + kill -9 + resume + 1, bit for bit in the published weights: the
    checkpoint (sharded by stage) restores both stages' actor and critic weights, both optimizers,
    schedulers and RNG; the critic's restored state reaches the actor through rollout 2's values."""
    from safetensors.torch import load_file

    straight = make_run(tmp_path / "straight", tiny_hf, nproc=2, train=PPO, rollout=dict(num_rollout=3))
    commit_rollouts(straight, range(3))
    run_trainer(straight, nproc=2, timeout=400)
    lines = metrics(straight)
    assert [l["step"] for l in lines] == list(range(6))
    assert all("pg_loss" not in l for l in lines[:2])  # critic-only warm-up
    for l in lines[2:]:
        for k in ("loss", "pg_loss", "kl", "entropy", "grad_norm", "value_loss", "value_clipfrac", "critic_grad_norm"):
            assert l.get(k) is not None and math.isfinite(l[k]), (k, l)
        assert l["grad_norm"] > 0 and l["critic_grad_norm"] > 0
    # the checkpoint holds both stages' shards (every rank wrote)
    assert (straight / "checkpoints" / "iter_0000003" / "rlslurm.json").exists()

    run = make_run(tmp_path / "run", tiny_hf, nproc=2, train=PPO, rollout=dict(num_rollout=3))
    commit_rollouts(run, range(2))
    log = tmp_path / "attempt0.log"
    proc = start_trainer(run, log)
    try:
        import time

        deadline = time.monotonic() + 300
        while '"iter_0000002"' not in ((run / "checkpoints" / "latest").read_text()
                                       if (run / "checkpoints" / "latest").exists() else ""):
            assert proc.poll() is None, log.read_text()[-6000:]
            assert time.monotonic() < deadline, "no checkpoint after 2 rollouts"
            time.sleep(0.3)
        time.sleep(1.0)  # now waiting for rollout 2, which this attempt never gets
        assert proc.poll() is None, log.read_text()[-6000:]
    finally:
        kill_tree(proc)
    assert not (run / "weights" / "v3").exists()
    commit_rollouts(run, range(2, 3))
    p = run_trainer(run, nproc=2, timeout=400)
    assert "resumed from" in p.stderr and "iter_0000002" in p.stderr
    a = load_file(str(straight / "weights" / "v3" / "model.safetensors"))
    b = load_file(str(run / "weights" / "v3" / "model.safetensors"))
    init = load_file(str(tiny_hf / "model.safetensors"))
    assert a.keys() == b.keys() == init.keys()  # every stage's layers reached the one writer
    differ = [n for n in a if not torch.equal(a[n], b[n])]
    assert not differ, differ
    assert all(not torch.equal(a[n], init[n]) for n in a)  # trained, not just copied
    resumed = [l for l in metrics(run) if l["rollout_id"] == 2]
    for x, y in zip(lines[4:], resumed):
        assert x["loss"] == y["loss"] and x["value_loss"] == y["value_loss"], (x, y)
