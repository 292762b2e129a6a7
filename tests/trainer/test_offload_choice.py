"""--colocate's choice of what the trainer moves off the GPU while the engines generate
(rlslurm/trainer/offload_choice.py): by default the cheapest moves (in PCIe copies) that fit beside the
engines' weights, SGLang's reserve and a KV cache for a whole rollout; the user's
--offload-train / --no-offload-train win; on CPU everything stays. The numbers are the shipped model
configs' on an 80 GiB GPU."""

from __future__ import annotations

import pytest
import torch

from rlslurm.settings.config import RunConfig
from rlslurm.settings.model_config import load_model_config
from rlslurm.trainer.offload_choice import (
    GIB,
    SETS,
    EnginesNeed,
    choose,
    decide,
    engines_need,
    kv_bytes_per_token,
    pending_optimizer_bytes,
    recheck,
)

BUCKET = 512 * 2**20  # --update-weight-buffer-size's default


def _cfg(*, gpus: int, batch: int, samples: int, response: int, engine_tp: int = 1) -> RunConfig:
    return RunConfig.model_validate({
        "run": {"colocate": True}, "slurm": {"nodes": 1, "trainer_nodes": 1, "rollout_nodes": 1, "gpus_per_node": gpus},
        "rollout": {"rollout_batch_size": batch, "n_samples_per_prompt": samples, "rollout_max_response_len": response,
                    "rollout_num_gpus_per_engine": engine_tp}})


def _state(model: str, *, tp: int, dp: int) -> dict[str, int]:
    """One trainer rank's state: bf16 params, fp32 gradients (megatron's main grads), fp32 main params and
    Adam's two moments sharded over DP by the distributed optimizer. For qwen3-1.7B on one GPU that is
    3.20 + 6.41 + 19.2 GiB, as measured (bench/results/colocate-offload-h200x4.md)."""
    n = load_model_config(model).num_params
    return {"params": 2 * n // tp, "grads": 4 * n // tp, "rest": 12 * n // (tp * dp)}


def _auto(model: str, state: dict[str, int], cfg: RunConfig, *, total: int = 80 * GIB):
    mc = load_model_config(model)
    usable = total - GIB  # the CUDA context and NCCL's buffers
    return decide(state, usable=usable, total=total, need=engines_need(cfg, mc, total), bucket=BUCKET)


def test_the_bench_figures_are_what_the_state_formula_gives() -> None:
    s = _state("qwen3-1.7B", tp=1, dp=1)
    assert [round(s[k] / GIB, 1) for k in SETS] == [3.2, 6.4, 19.2]


def test_qwen3_1p7b_stays_resident_and_qwen3_4b_moves_what_it_must_on_80_gib() -> None:
    # the shipped one-node defaults (32 prompts x 8 samples, 8192-token responses), eight GPUs, each with
    # a trainer rank (1.7B: TP 1, DP 8; 4B: TP 2, DP 4) and a TP 1 engine
    shipped = _cfg(gpus=8, batch=32, samples=8, response=8192)
    small = _auto("qwen3-1.7B", _state("qwen3-1.7B", tp=1, dp=8), shipped)
    assert small.moves == () and small.keeps == SETS, small.line
    big = _auto("qwen3-4B", _state("qwen3-4B", tp=2, dp=4), shipped)
    # its 7.5 GiB of gradients make room enough, at no copy: its sharded optimizer state (5.6 GiB) stays
    assert big.moves == ("grads",) and big.keeps == ("params", "rest"), big.line
    assert big.describe().startswith("offload-train auto: keeps params, optimizer state resident, moves grads (")
    # the bench's shape (bench/results/colocate-offload-h200x4.md): 16 x 8 samples of 256 tokens, one GPU
    bench = _cfg(gpus=1, batch=16, samples=8, response=256)
    assert _auto("qwen3-1.7B", _state("qwen3-1.7B", tp=1, dp=1), bench).moves == ()
    one = _auto("qwen3-4B", _state("qwen3-4B", tp=1, dp=1), bench)
    # its gradients and as much of its 45 GiB of optimizer state as does not fit beside the engines
    t = one.terms_gib
    assert one.moves == ("grads", "rest") and 0 < one.keep_rest < _state("qwen3-4B", tp=1, dp=1)["rest"], one.line
    assert one.keep_rest / GIB == pytest.approx(t["usable"] - t["trainer_params"] - t["margin"] - t["engine_weights"]
                                                - t["sglang_reserve"] - t["kv_target"]) == pytest.approx(t["rest_kept"])
    assert f"and {one.keep_rest / GIB:.2f} GiB of the optimizer state resident, moves grads and its other" in one.line
    # every term is in the record, in GiB
    assert big.terms_gib["kv_target"] == (32 * 9216 * kv_bytes_per_token(load_model_config("qwen3-4B").arch, 1, 2)
                                          / GIB)


def test_a_tiny_model_always_stays() -> None:
    for total in (24 * GIB, 80 * GIB):
        tiny = _auto("tiny-qwen3", _state("tiny-qwen3", tp=1, dp=1), _cfg(gpus=1, batch=32, samples=8,
                                                                              response=8192), total=total)
        assert tiny.moves == (), tiny.line


def test_the_gradients_move_before_the_optimizer_state_where_they_make_room_enough() -> None:
    """The gradients are scratch (dropped, zeroed, never copied): where moving them fits, the optimizer
    state stays and no turn copies it. Engines' need invented, sized between what keeping everything
    and keeping all but the gradients leave."""
    s = _state("qwen3-1.7B", tp=1, dp=1)  # 3.2 / 6.4 / 19.2 GiB
    usable, total = 79 * GIB, 80 * GIB
    kept_all = sum(s.values())

    def with_engines(need: int):
        return decide(s, usable=usable, total=total, bucket=BUCKET, need=EnginesNeed(weights=0, reserve=need, kv=0))

    roomy = with_engines(usable - kept_all - 3 * GIB)
    assert roomy.moves == (), roomy.line
    tight = with_engines(usable - kept_all - 3 * GIB + 4 * GIB)  # 1 GiB over with everything kept
    assert tight.moves == ("grads",) and tight.keeps == ("params", "rest"), tight.line
    assert tight.describe().startswith("offload-train auto: keeps params, optimizer state resident, moves grads (")
    # the gradients' 6.4 GiB are not enough (8.5 GiB short, the margin's 1.5 included): they go, and of the
    # optimizer state only the 2.1 GiB still short
    tighter = with_engines(usable - kept_all - 3 * GIB + 10 * GIB)
    assert tighter.moves == ("grads", "rest") and tighter.keeps == ("params",), tighter.line
    short = kept_all + tighter.terms_gib["margin"] * GIB + tighter.terms_gib["sglang_reserve"] * GIB - usable
    assert short / GIB == pytest.approx(8.5, abs=0.01)
    assert tighter.keep_rest == pytest.approx(s["rest"] - (short - s["grads"]), abs=1)


def test_where_not_even_everything_moved_fits_everything_moves() -> None:
    # qwen3-4B on one 40 GiB GPU with 256 samples of 9216 tokens: the KV target alone is larger
    c = _auto("qwen3-4B", _state("qwen3-4B", tp=1, dp=1), _cfg(gpus=1, batch=32, samples=8, response=8192),
              total=40 * GIB)
    assert c.moves == SETS and "does not fit even so" in c.line


def test_the_users_flag_wins_and_cpu_keeps_everything() -> None:
    state = _state("qwen3-1.7B", tp=1, dp=8)
    fits = _auto("qwen3-1.7B", state, _cfg(gpus=8, batch=32, samples=8, response=8192))
    assert fits.moves == ()
    on = choose(True, state, fits)
    assert on.moves == SETS and on.setting == "--offload-train" and on.auto_keeps == SETS
    assert "auto would keep params, grads, optimizer state" in on.line
    off = choose(False, _state("qwen3-4B", tp=1, dp=1), _auto("qwen3-4B", _state("qwen3-4B", tp=1, dp=1),
                                                             _cfg(gpus=1, batch=32, samples=8, response=8192),
                                                             total=40 * GIB))
    assert off.moves == () and off.setting == "--no-offload-train"
    assert choose(None, state, fits) is fits
    cpu = choose(None, state, None)
    assert cpu.moves == () and cpu.setting == "auto" and "--device cpu" in cpu.line
    assert choose(True, state, None).moves == SETS


def test_kv_bytes_per_token_per_gpu_by_attention_kind() -> None:
    qwen = load_model_config("qwen3-1.7B").arch  # 28 layers, 8 KV heads of 128
    assert kv_bytes_per_token(qwen, 1, 2) == 2 * 28 * 8 * 128 * 2
    assert kv_bytes_per_token(qwen, 2, 2) == 2 * 28 * 4 * 128 * 2
    assert kv_bytes_per_token(qwen, 16, 2) == 2 * 28 * 1 * 128 * 2  # fewer heads than GPUs: replicated
    mla = load_model_config("deepseek-v3").arch  # the latent and the rotary key, whole on every GPU
    assert kv_bytes_per_token(mla, 8, 2) == (mla.mla.kv_lora_rank + mla.mla.qk_pos_emb_head_dim) * mla.num_layers * 2
    nxt = load_model_config("tiny-qwen3-next").arch  # only the full-attention layers
    full = nxt.num_layers // nxt.gated_delta_net.full_attention_interval
    assert 0 < full < nxt.num_layers
    assert kv_bytes_per_token(nxt, 1, 2) == 2 * full * nxt.num_query_groups * nxt.kv_channels * 2


def test_adams_moments_are_counted_before_the_first_step_makes_them() -> None:
    from types import SimpleNamespace

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    st = SimpleNamespace(actor=SimpleNamespace(model=model, optimizer=opt), critic=None)
    assert pending_optimizer_bytes(st, torch.device("cpu")) == 2 * (12 + 3) * 4
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    assert pending_optimizer_bytes(st, torch.device("cpu")) == 0


def test_the_margin_the_engines_leave_holds_the_moments_a_resident_optimizer_will_make() -> None:
    """The engines size their share on what is free when they start, before the trainer's first step makes
    Adam's moments. Before: the margin left them out, and on one H100 the trainer that kept its optimizer
    state (qwen3-1.7B, the default) took 12.8 GiB of the engines' share at its first step; the engine's
    resume after that turn died of CUDA OOM (bench/results/gpu-lease-2026-12-07.md)."""
    from types import SimpleNamespace

    from rlslurm.engines.memory_share import trainer_margin
    from rlslurm.trainer.colocate import rank_margin
    from rlslurm.trainer.offload_choice import Choice

    model = torch.nn.Linear(64, 32)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    st = SimpleNamespace(actor=SimpleNamespace(model=model, optimizer=opt), critic=None, device=torch.device("cpu"))
    params = (64 * 32 + 32) * 4
    moments = 2 * params
    total = 80 * GIB
    keeps_all = Choice("auto", (), "keeps everything", auto_keeps=SETS)
    moves_rest = Choice("auto", ("rest",), "moves optimizer state", auto_keeps=("params", "grads"))
    moves_all = Choice("--offload-train", SETS, "moves everything")
    assert rank_margin(st, keeps_all, BUCKET, total, trains_beside=False) == trainer_margin(0, BUCKET, total) + moments
    assert rank_margin(st, moves_rest, BUCKET, total, trains_beside=False) == trainer_margin(0, BUCKET, total)
    assert rank_margin(st, moves_all, BUCKET, total, trains_beside=False) == trainer_margin(params, BUCKET, total)
    # the rest moves but for what fits (`keep_rest`), 100 bytes of it on the GPU already: of the moments to
    # come, those that fit in what is left of it stay, and only those
    part = Choice("auto", ("grads", "rest"), "moves part of the optimizer state", auto_keeps=("params",),
                  keep_rest=100 + moments // 4)
    assert rank_margin(st, part, BUCKET, total, trains_beside=False, rest_on_gpu=100) == (
        trainer_margin(0, BUCKET, total) + moments // 4)
    full = rank_margin(st, part, BUCKET, total, trains_beside=False, rest_on_gpu=10**9)
    assert full == trainer_margin(0, BUCKET, total)
    model(torch.ones(2, 64)).sum().backward()
    opt.step()  # made: on the GPU already when the engines start (a resumed optimizer too)
    assert rank_margin(st, keeps_all, BUCKET, total, trains_beside=False) == trainer_margin(0, BUCKET, total)


def test_a_trainer_that_grew_past_its_room_moves_the_cheapest_sets_that_bring_every_rank_back() -> None:
    """The re-check at each turn's end (trainer/colocate.py `Colocation._recheck`): the engines left each
    rank its held bytes at their start plus a margin; where a rank holds more, the cheapest moves that
    bring every rank within its room (the gradients, no copy; then as much of the optimizer state as the
    rank short of the most needs), the same on every rank. Sizes: a qwen3-1.7B rank's sets on the GPU
    (3.2 / 6.4 / 19.2 GiB) and a room of 30 GiB (invented)."""
    sizes = {"params": int(3.2 * GIB), "grads": int(6.4 * GIB), "rest": int(19.2 * GIB)}
    room = 30 * GIB
    fits = (int(28.8 * GIB), room, sizes)
    # within its room: nothing changes, nothing is said
    assert recheck((), 0, [fits, fits]) == ((), 0, "")
    # one rank grew by 1 GiB: the gradients make the room, on both ranks, and the optimizer state stays
    moves, keep, line = recheck((), 0, [fits, (int(31 * GIB), room, sizes)])
    assert (moves, keep) == (("grads",), 0)
    assert "holds 31.00 GiB beside the engines, 1.00 GiB more than the 30.00 GiB they left it" in line
    assert "now moves grads too (keeps params, optimizer state)" in line
    # by 8 GiB: the gradients and the 1.6 GiB of optimizer state they leave short; the rest of it stays
    moves, keep, line = recheck((), 0, [fits, (int(38 * GIB), room, sizes)])
    assert moves == ("grads", "rest") and keep == sizes["rest"] - (8 * GIB - sizes["grads"])
    assert line.endswith(f"now moves grads, optimizer state beyond {keep / GIB:.2f} GiB too "
                         f"(keeps params, {keep / GIB:.2f} GiB of optimizer state)")
    # moving part of it already (17.6 GiB stay, all on the GPU) and 1 GiB over again: 1 GiB less stays
    part = {**sizes, "grads": 0, "rest": keep}
    assert recheck(moves, keep, [(31 * GIB, room, part)])[:2] == (moves, keep - GIB)
    # by more than the gradients and all the rest: the params go too
    assert recheck((), 0, [(int(28.8 * GIB) + 27 * GIB, room, sizes)])[:2] == (SETS, 0)
    # nothing left to move: unchanged, and said
    moves, keep, line = recheck(SETS, 0, [(2 * GIB, GIB, sizes)])
    assert moves == SETS and "has nothing left to move" in line


def test_the_recheck_of_the_lease_run_moves_the_gradients_not_the_optimizer_state() -> None:
    """qwen3-1.7B colocated with every default on one H100 (bench/results/gpu-lease-2026-12-07c.md,
    control/colocate_memory.json): after its first step the trainer held 30.83 GiB beside the engines,
    0.39 GiB over the 30.43 GiB they left it. The optimizer state moved (0.48 + 0.43 s a turn, 11.7 % of
    the iteration); the gradients, kept and scratch, make that room with no copy."""
    sizes = {"params": int(3.205 * GIB), "grads": int(6.41 * GIB), "rest": int(19.229 * GIB)}
    moves, keep, line = recheck((), 0, [(int(30.83 * GIB), int(30.43 * GIB), sizes)])
    assert (moves, keep) == (("grads",), 0), line


