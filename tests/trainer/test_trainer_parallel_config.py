"""Parallel layouts the RL trainer refuses, each with an error that names the flag and why
(no torch.distributed needed: the checks run before any process group or model exists)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlslurm.errors import ConfigError
from rlslurm.models import build as model_mod
from rlslurm.settings.model_config import load_model_config
from rlslurm.trainer.setup import check_context_parallel, check_pipeline


def _tcfg(**kw):
    base = dict(virtual_pipeline_model_parallel_size=None, overlap_p2p_comm=False, mtp_num_layers=None)
    return SimpleNamespace(**{**base, **kw})


def test_context_parallel_is_accepted_but_a_comm_type_it_does_not_do(tmp_path) -> None:
    """CP > 1 builds (docs/context-parallel.md), dense or MLA; a megatron CP communication scheme other
    than the all-gather rlslurm's attention does is refused in one line, not silently replaced."""
    from rlslurm.settings.config import RunConfig

    def cfg(cp: int, megatron: dict | None = None) -> RunConfig:
        return RunConfig.model_validate({"run": {"run_name": "t", "run_dir": str(tmp_path), "device": "cpu"},
                                         "model": {"model": "tiny-qwen3"}, "train": {"context_parallel_size": cp},
                                         "megatron": megatron or {}})

    check_context_parallel(cfg(1, {"cp_comm_type": "a2a"}))
    check_context_parallel(cfg(2), load_model_config("tiny-deepseek-v3"))
    check_context_parallel(cfg(2, {"cp_comm_type": "allgather"}))
    with pytest.raises(ConfigError, match=r"^--megatron-cp-comm-type a2a: .*all-gathers keys and values"):
        check_context_parallel(cfg(2, {"cp_comm_type": "a2a"}))


def test_pipeline_checks_name_the_flag() -> None:
    mc = load_model_config("tiny-qwen3")  # 2 layers
    check_pipeline(mc, _tcfg(), 1)
    check_pipeline(mc, _tcfg(), 2)
    # the layer split and the interleaved schedule: where the TransformerConfig is made (parallel_grid.py)
    with pytest.raises(ConfigError, match=r"^--pipeline-model-parallel-size 4 does not divide tiny-qwen3's 2 layers"):
        model_mod.transformer_config(mc, pp=4)
    with pytest.raises(ConfigError, match=r"^--megatron-virtual-pipeline-model-parallel-size: the interleaved"):
        model_mod.transformer_config(mc, pp=2, overrides={"virtual_pipeline_model_parallel_size": 2})
    with pytest.raises(ConfigError, match=r"^--megatron-account-for-loss-in-pipeline-split: rlslurm splits"):
        model_mod.transformer_config(mc, pp=2, overrides={"account_for_loss_in_pipeline_split": True})
    with pytest.raises(ConfigError, match=r"^--megatron-num-layers-in-last-pipeline-stage: .*"
                                          r"use --decoder-last-pipeline-num-layers"):
        model_mod.transformer_config(mc, pp=2, overrides={"num_layers_in_last_pipeline_stage": 1})
    with pytest.raises(ConfigError, match=r"--megatron-overlap-p2p-comm"):
        check_pipeline(mc, _tcfg(overlap_p2p_comm=True), 2)
    with pytest.raises(ConfigError, match=r"--megatron-mtp-num-layers"):
        check_pipeline(mc, _tcfg(mtp_num_layers=1), 2)


def test_pipeline_sets_what_the_schedule_needs() -> None:
    """PP > 1: stages exchange activation shapes (RL micro-batches differ in length), and the MoE
    dispatcher is one that megatron allows with variable lengths; PP = 1 keeps megatron's defaults."""
    mc = load_model_config("tiny-qwen3-moe")
    pp2 = model_mod.transformer_config(mc, pp=2)
    assert pp2.variable_seq_lengths and pp2.moe_token_dispatcher_type == "alltoall"
    pp1 = model_mod.transformer_config(mc, pp=1)
    assert not pp1.variable_seq_lengths


def test_collate_pads_to_the_sequence_parallel_multiple() -> None:
    import torch

    from rlslurm.buffer import Sample
    from rlslurm.trainer.batching import collate

    s = [Sample(prompt_tokens=[5, 6], response_tokens=[7]), Sample(prompt_tokens=[8], response_tokens=[9, 10, 11, 12])]
    assert collate(s, [0, 1], torch.device("cpu")).tokens.shape == (2, 5)
    mb = collate(s, [0, 1], torch.device("cpu"), pad_multiple=2)
    assert mb.tokens.tolist() == [[5, 6, 7, 0, 0, 0], [8, 9, 10, 11, 12, 0]]
    assert mb.prompt_lens == [2, 1] and mb.response_lens == [1, 4]
    with pytest.raises(ValueError, match="pad_multiple"):
        collate(s, [0], torch.device("cpu"), pad_multiple=0)


@pytest.mark.parametrize("tp, ep, etp, pp, world", [
    (1, 2, 1, 1, 2), (2, 2, 2, 1, 4), (2, 2, 1, 1, 4), (2, 2, 1, 2, 8), (4, 2, 1, 1, 8), (8, 32, 1, 4, 128),
    (2, 3, 1, 1, 6), (4, 1, 2, 1, 8), (1, 1, 1, 2, 4), (2, 1, 1, 1, 2)])
def test_export_takes_every_rank_its_gathers_reach(tp, ep, etp, pp, world) -> None:
    """The ranks that iterate an HF export (convert/parallel.py export_roles) are the first
    `exporting_dp_ranks` dense DP ranks of each stage: exactly the smallest set that holds DP 0 and
    every member of each TP, ETP and EP group one of them gathers over, in megatron-core's own rank
    groups (its RankGenerator, as initialize_model_parallel builds them). The rule before ETP, DP 0
    alone, misses ranks whenever the EP group leaves the TP group (ETP x EP not dividing TP)."""
    from megatron.core.parallel_state import RankGenerator

    from rlslurm.settings.parallel_grid import exporting_dp_ranks

    order, dp = "tp-cp-ep-dp-pp", world // (tp * pp)
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order=order)
    expert = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order=order)
    groups = dense.get_ranks("tp") + expert.get_ranks("tp") + expert.get_ranks("ep")
    dp_rank = {r: i for g in dense.get_ranks("dp") for i, r in enumerate(g)}
    k = exporting_dp_ranks(tp=tp, cp=1, ep=ep, etp=etp)
    for s in range(pp):  # each stage from its DP 0
        stage_ranks = {g[s] for g in dense.get_ranks("pp")}
        reach = {r for r in stage_ranks if dp_rank[r] == 0}
        while grown := {r for g in groups if reach & set(g) for r in g} - reach:
            reach |= grown
        assert reach == {r for r in stage_ranks if dp_rank[r] < k}
    assert (k == 1) == (tp % (etp * ep) == 0)


UNEVEN = [(61, 4, None, 13), (94, 4, None, 22), (61, 8, None, 5), (78, 8, 14, 16), (5, 2, 2, None), (5, 2, None, 2),
          (5, 4, 1, 2), (7, 3, 3, None), (6, 3, None, None)]
REFUSED = [(61, 4, None, None, "does not divide x's 61 layers"), (61, 4, None, 12, "share 49 of x's 61 layers"),
           (5, 2, 2, 2, "the 0 other stages would hold 1"), (5, 3, 2, 3, "the 1 other stage would hold 0"),
           (5, 4, 1, 1, "share 3 of x's 5 layers"), (5, 1, 2, None, "needs --pipeline-model-parallel-size > 1")]


def _megatron_split(num_layers: int, pp: int, first, last) -> list[tuple[int, int]]:
    """(offset, layers) of each stage as megatron-core builds them, from its own functions."""
    import torch
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    cfg = TransformerConfig(num_layers=num_layers, hidden_size=8, num_attention_heads=1,
                            pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                            num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last)
    return [(get_transformer_layer_offset(cfg, pp_rank=r), get_num_layers_to_build(cfg, pp_rank=r)) for r in range(pp)]


@pytest.mark.parametrize("num_layers, pp, first, last", UNEVEN)
def test_stage_split_is_megatrons(num_layers, pp, first, last) -> None:
    """rlslurm's rule (parallel_grid.stage_layers: what resolve and the converter check, and the
    layer counts slime's scripts give) against megatron-core 0.16's own: each stage's layer count,
    and its offset (where its layer_number, which conversion and weight sync read, starts)."""
    import itertools

    from rlslurm.settings.parallel_grid import stage_layers

    ours = stage_layers(num_layers, pp, first, last)
    offsets = [0, *itertools.accumulate(ours)][:-1]
    assert list(zip(offsets, ours)) == _megatron_split(num_layers, pp, first, last)


@pytest.mark.parametrize("num_layers, pp, first, last, said", REFUSED)
def test_stage_split_refuses_what_megatron_refuses(num_layers, pp, first, last, said) -> None:
    """Each refusal is one line naming the flags, and megatron-core would have refused too (its
    TransformerConfig, or the assert in get_num_layers_to_build on some stage)."""
    from rlslurm.settings.parallel_grid import stage_layers

    with pytest.raises(ConfigError) as e:
        stage_layers(num_layers, pp, first, last, model="x")
    assert said in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith("--decoder-" if first or last else "--pipeline-model-parallel-size")
    with pytest.raises((AssertionError, ValueError)):
        _megatron_split(num_layers, pp, first, last)
