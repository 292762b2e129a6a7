"""HF <-> Megatron parity on real megatron-core (CPU, gloo), every family, TP=1, TP=2 and EP=2.

tests/convert/parity_worker.py builds the GPTModel from the model config, loads the HF checkpoint
through rlslurm.convert, and compares with HF transformers on the same files and input: (a) logits,
(b) token log-probs from megatron's vocab-parallel cross entropy with the TP vocab padding masked,
(c) every parameter's gradient of the summed token NLL (exported through the same mapping), and
(d) the exported HF tensors with the files, bit for bit; (e) the loss across parallel layouts, before
and after one gradient step clipped by megatron's gradient norm.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from convert_helpers import FAMILIES, UNMAPPED, check, run_procs

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

MOE = ["tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-moonlight", "tiny-glm4-moe", "tiny-glm4-moe-lite", "tiny-minimax-m2",
       "tiny-qwen3-next", "tiny-qwen3.5-moe"]
# HF keeps the router correction bias as a buffer (no gradient): one per MoE layer
ROUTER_BIAS_BUFFERS = {"tiny-deepseek-v3": 1, "tiny-moonlight": 1, "tiny-glm4-moe": 1, "tiny-glm4-moe-lite": 1,
                       "tiny-minimax-m2": 2}
# GLM-5: sparse attention (top-4 keys of the 12-token rows; layer 2 reuses layer 1's, as GLM-5.2) on
# GLM-4.7-Flash's MLA and MoE (2 MoE layers)
GLM5 = "tiny-glm-moe-dsa"
MOE += [GLM5]
ROUTER_BIAS_BUFFERS[GLM5] = 2
TIED = "tiny-qwen3-tied"  # tiny-qwen3 with tied embeddings (like Qwen3-4B), written by the fixture
LAYOUTS = {"tp1": (1, 1, FAMILIES + [TIED]), "tp2": (2, 1, FAMILIES + [TIED]), "ep2": (2, 2, MOE)}
CASES = [(layout, m) for layout, (_, _, models) in LAYOUTS.items() for m in models]


def _models(request: pytest.FixtureRequest, out: Path) -> tuple[Path, list[str]]:
    """The checkpoint root and the model configs: every family and the tied one (written into `out`)."""
    from rlslurm.settings.model_config import MODEL_CONFIG_DIR, load_model_config
    from rlslurm.tiny import make_tiny_checkpoint

    tiny_ckpts = request.getfixturevalue("tiny_ckpts")
    tied = out / f"{TIED}.yaml"
    if not tied.exists():
        tied.write_text((MODEL_CONFIG_DIR / "tiny-qwen3.yaml").read_text()
                        .replace("name: tiny-qwen3\n", f"name: {TIED}\n")
                        .replace("tie_word_embeddings: false", "tie_word_embeddings: true"))
        assert load_model_config(str(tied)).arch.tie_word_embeddings
        make_tiny_checkpoint(load_model_config(str(tied)), tiny_ckpts / TIED)
    return tiny_ckpts, [*FAMILIES, str(tied)]


def two_rank_run(request: pytest.FixtureRequest, out: Path) -> list[str]:
    """TP=2, then EP=2 (MoE), on 2 ranks (in the session's one 2-process torchrun of tests/convert,
    conftest.py two_rank_runs)."""
    tiny_ckpts, models = _models(request, out)
    return ["tests/convert/parity_worker.py", "--ckpt-root", str(tiny_ckpts), "--out", str(out), "--ep", "1,2", *models]


@pytest.fixture(scope="module")
def parity(request, two_rank_runs) -> dict[str, dict[str, dict]]:
    out = two_rank_runs[__name__]
    tiny_ckpts, models = _models(request, out)
    check(run_procs(1, ["tests/convert/parity_worker.py", "--ckpt-root", str(tiny_ckpts), "--out", str(out),
                        "--ep", "1", *models], timeout=300))
    results: dict[str, dict[str, dict]] = {}
    for layout, (nproc, ep, models) in LAYOUTS.items():
        tp = nproc // ep
        results[layout] = {m: json.loads((out / f"{m}.tp{tp}.ep{ep}.json").read_text()) for m in models}
    return results


def _get(parity, layout, model):
    r = parity[layout][model]
    assert r["ok"], r.get("error")
    return r


@pytest.mark.parametrize("layout,model", CASES)
def test_logits_match_hf(parity, layout, model):
    r = _get(parity, layout, model)
    assert r["ref_logit_scale"] > 0.1  # a real signal, not all-zero logits
    assert r["max_abs_logits"] < 1e-5, r


@pytest.mark.parametrize("layout,model", CASES)
def test_trainer_logprobs_and_gradients_match_hf(parity, layout, model):
    r = _get(parity, layout, model)
    assert r["max_abs_logprobs"] < 1e-5, r
    assert r["grad_finite"]
    assert r["grads_compared"] == r["exported"] - ROUTER_BIAS_BUFFERS.get(model, 0)
    assert r["grad_scale"] > 0.1
    assert r["max_abs_grad"] < 1e-4, r["worst_grads"]


@pytest.mark.parametrize("layout,model", CASES)
def test_export_round_trip_is_bit_exact(parity, layout, model):
    r = _get(parity, layout, model)
    # MiMo's and Qwen3-Next's MTP tensors and Qwen3.5's vision tower are in the file, and by design not in
    # the export (UNMAPPED)
    prefix, count = UNMAPPED.get(model, ("", 0))
    assert len(r["missing_in_export"]) == count and all(n.startswith(prefix) for n in r["missing_in_export"])
    assert r["extra_in_export"] == []
    assert r["not_bit_exact"] == []
    assert r["exported"] > 0


@pytest.mark.parametrize("model", FAMILIES + [TIED])
def test_parallel_layouts_give_the_same_loss(parity, model):
    base = _get(parity, "tp1", model)["loss"]
    for layout in ("tp2", "ep2"):
        if model in parity[layout]:
            assert abs(_get(parity, layout, model)["loss"] - base) < 1e-5, (layout, model)


@pytest.mark.parametrize("model", FAMILIES + [TIED])
def test_parallel_layouts_take_the_same_clipped_step(parity, model):
    """One gradient step clipped by the gradient norm as megatron's optimizer takes it (parity_worker.py
    `_sgd_step_loss`): the norm counts every TP-sharded parameter's shards once and a replicated one
    once, so it is the same at every layout, and so is the loss after the step. (Without the
    tensor-parallel marks on MiniMax-M2's sharded q/k norm weights, its TP=2 norm is 7.7e-6 off, relative.)"""
    base = _get(parity, "tp1", model)
    assert base["step_grad_norm"] > 1.0 and abs(base["step_loss"] - base["loss"]) > 1e-2  # the step moved the loss
    for layout in ("tp2", "ep2"):
        if model in parity[layout]:
            r = _get(parity, layout, model)
            assert r["step_grad_norm"] == pytest.approx(base["step_grad_norm"], rel=1e-6), (layout, model)
            assert abs(r["step_loss"] - base["step_loss"]) < 1e-5, (layout, model)


def test_glm5_trains_megatrons_sparse_attention_with_its_indexer_frozen(parity):
    """tiny-glm-moe-dsa is built with megatron-core's DSA core attention and rlslurm's GLM-5 indexer
    (models/dsa.py) in its layers 0 and 1 and, in layer 2, GLM-5.2's shared top-k attention, at every
    layout; the indexer's k norm at transformers' 1e-6, and its 5 tensors per indexer frozen
    (transformers computes it under no_grad: its gradient there is 0)."""
    for layout in LAYOUTS:
        d = _get(parity, layout, GLM5)["dsa"]
        assert d["core_attention"] == ["GLM5DSAttention", "SharedTopKAttention"], (layout, d)
        assert d["indexers"] == ["GLM5Indexer"], (layout, d)
        assert d["k_norm_eps"] == [1e-6]
        assert len(d["frozen"]) == 10 and all(".core_attention.indexer." in n for n in d["frozen"]), d["frozen"]
