"""The mapping's re-layouts and tables, without megatron: layouts checked element by element,
tables checked against the tensor names of real transformers models of every family."""

from __future__ import annotations

import pytest
import torch
from convert_helpers import FAMILIES, UNMAPPED, mapped

from rlslurm.convert import HFCheckpoint, hf_to_mcore, mapping as M
from rlslurm.models.build import padded_vocab_size
from rlslurm.settings.model_config import load_model_config


def test_fuse_qkv_groups_heads_by_query_group():
    # 4 query heads, 2 groups, head_dim 1: rows labelled by origin.
    q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])
    k = torch.tensor([[20.0], [21.0]])
    v = torch.tensor([[30.0], [31.0]])
    fused = M.fuse_qkv(q, k, v, groups=2)
    assert fused.flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    back = M.split_qkv(fused, groups=2, heads=4, head_dim=1)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))


def test_qkv_bias_round_trip_and_tp_shard_is_whole_groups():
    q, k, v = torch.arange(8.0), torch.arange(100.0, 104.0), torch.arange(200.0, 204.0)  # 4 heads, 2 groups, d=2
    fused = M.fuse_qkv(q, k, v, groups=2)
    r0 = M.shard("qkv", fused, 0, 2, partition_dim=0)
    assert r0.tolist() == [0, 1, 2, 3, 100, 101, 200, 201]  # group 0 entirely on rank 0
    assert torch.equal(M.unshard("qkv", [r0, M.shard("qkv", fused, 1, 2, partition_dim=0)], partition_dim=0), fused)


def test_gate_up_shard_gives_each_rank_its_gate_and_up_halves():
    gate, up = torch.arange(4.0).unsqueeze(1), torch.arange(10.0, 14.0).unsqueeze(1)
    full = torch.cat([gate, up])
    parts = [M.shard("gate_up", full, r, 2, partition_dim=0) for r in range(2)]
    assert parts[0].flatten().tolist() == [0, 1, 10, 11]
    assert parts[1].flatten().tolist() == [2, 3, 12, 13]
    assert torch.equal(M.unshard("gate_up", parts, partition_dim=0), full)
    # the plain (contiguous) split would be different: the kind matters
    assert not torch.equal(M.shard("plain", full, 0, 2, partition_dim=0), parts[0])


def test_vocab_padded_on_import_trimmed_on_export():
    mc = load_model_config("tiny-qwen3")
    lay = M.Layout.of(mc, vocab_padded=padded_vocab_size(64, 2))
    rule = M.Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab")
    emb = torch.randn(64, 8)
    full = M.to_mcore(rule, [emb], lay)
    assert full.shape == (256, 8) and torch.equal(full[:64], emb) and not full[64:].any()
    assert torch.equal(M.to_hf(rule, full, lay)[0], emb)
    with pytest.raises(Exception, match="model.embed_tokens.weight"):
        M.to_mcore(rule, [torch.randn(63, 8)], lay)


@pytest.mark.parametrize("vocab,tp,expected", [(64, 1, 128), (64, 2, 256), (151936, 4, 152064), (512, 4, 512)])
def test_padded_vocab_size(vocab, tp, expected):
    assert padded_vocab_size(vocab, tp) == expected


@pytest.mark.parametrize("name", FAMILIES)
def test_table_covers_exactly_the_hf_checkpoint(tiny_ckpts, name):
    mc = load_model_config(name)
    expected = M.expected_hf_names(mc)
    assert len(expected) == len(set(expected))
    names = set(HFCheckpoint(tiny_ckpts / name).names())
    assert set(expected) == mapped(name, names)
    assert len(names) - len(expected) == UNMAPPED.get(name, (None, 0))[1]


@pytest.mark.parametrize("name", FAMILIES)
def test_streamed_import_at_tp2_reassembles_to_the_hf_tensors(tiny_ckpts, name):
    """hf_to_mcore over an iterator (streaming) for both TP ranks, then unshard + to_hf."""
    mc = load_model_config(name)
    ckpt = HFCheckpoint(tiny_ckpts / name)
    targets = M.default_targets(mc)
    shards = [dict(hf_to_mcore(mc, iter(ckpt), r, 2, vocab_size_padded=256)) for r in range(2)]
    assert set(shards[0]) == set(targets)
    lay = M.Layout.of(mc, 256)
    seen = set()
    for name_, dim in targets.items():
        res = M.resolve(mc, name_)
        full = M.unshard(res.rule.kind, [shards[0][name_], shards[1][name_]], partition_dim=dim,
                         sections=res.rule.sections)
        for hf_name, t in zip(res.hf_names, M.to_hf(res.rule, full, lay)):
            assert torch.equal(t, ckpt.get(hf_name)), hf_name
            seen.add(hf_name)
    assert seen == mapped(name, ckpt.names())


def test_qwen2_table_has_qkv_biases_and_a_tied_head():
    """Qwen2: q/k/v biases fused into linear_qkv.bias (split with the weight over TP), nothing for
    o_proj or the MLP, no q/k norm; tiny-qwen2 ties embeddings, so the head reads embed_tokens."""
    mc = load_model_config("tiny-qwen2")
    bias = M.resolve(mc, "decoder.layers.1.self_attention.linear_qkv.bias")
    assert bias.rule.kind == "qkv" and bias.rule.tp_dim == 0
    assert bias.hf_names == tuple(f"model.layers.1.self_attn.{x}_proj.bias" for x in "qkv")
    targets = M.default_targets(mc)
    assert not any(n.endswith(("linear_proj.bias", "linear_fc1.bias", "linear_fc2.bias", "q_layernorm.weight"))
                   for n in targets)
    assert "output_layer.weight" not in targets
    assert M.resolve(mc, "output_layer.weight").hf_names == ("model.embed_tokens.weight",)
    assert "lm_head.weight" not in M.expected_hf_names(mc)
    untied = load_model_config("qwen2.5-7B")
    assert M.resolve(untied, "output_layer.weight").hf_names == ("lm_head.weight",)
    assert "model.layers.27.self_attn.v_proj.bias" in M.expected_hf_names(untied)


def test_glm4_moe_table():
    """GLM-4.5: q/k/v biases, q/k norm as the config says, a dense first layer with separate
    gate/up, then the router with its correction bias, routed and shared experts."""
    mc = load_model_config("tiny-glm4-moe")
    targets = M.default_targets(mc)
    bias = M.resolve(mc, "decoder.layers.0.self_attention.linear_qkv.bias")
    assert bias.rule.kind == "qkv" and bias.hf_names == tuple(f"model.layers.0.self_attn.{x}_proj.bias" for x in "qkv")
    assert M.resolve(mc, "decoder.layers.1.self_attention.q_layernorm.weight").hf_names == (
        "model.layers.1.self_attn.q_norm.weight",)
    assert M.resolve(mc, "decoder.layers.0.mlp.linear_fc1.weight").hf_names == (
        "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight")
    assert "decoder.layers.0.mlp.router.weight" not in targets
    assert M.resolve(mc, "decoder.layers.1.mlp.router.expert_bias").hf_names == (
        "model.layers.1.mlp.gate.e_score_correction_bias",)
    assert M.resolve(mc, "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight").hf_names == (
        "model.layers.1.mlp.experts.3.down_proj.weight",)
    assert M.resolve(mc, "decoder.layers.1.mlp.shared_experts.linear_fc1.weight").hf_names == (
        "model.layers.1.mlp.shared_experts.gate_proj.weight", "model.layers.1.mlp.shared_experts.up_proj.weight")
    assert not any(n.endswith(("linear_proj.bias", "linear_fc1.bias", "post_self_attn_layernorm.weight"))
                   for n in targets)
    # Air has no q/k norm; its 46 decoder layers end at 45 (46 is the MTP layer, unmapped)
    air = load_model_config("glm4.5-air")
    names = set(M.expected_hf_names(air))
    assert "model.layers.45.self_attn.q_proj.bias" in names
    assert "model.layers.45.mlp.experts.127.up_proj.weight" in names
    assert not any(".q_norm." in n or ".k_norm." in n or n.startswith("model.layers.46.") for n in names)
    assert "model.layers.0.mlp.gate_proj.weight" in names and "model.layers.0.mlp.gate.weight" not in names


def test_glm4_moe_mtp_tensors_are_skipped(tiny_ckpts):
    """A released GLM-4.5 checkpoint appends its MTP layer as model.layers.{num_layers}.*: a
    streamed import takes the decoder layers and leaves those tensors unread."""
    mc = load_model_config("tiny-glm4-moe")
    ckpt = HFCheckpoint(tiny_ckpts / "tiny-glm4-moe")
    n, h = mc.arch.num_layers, mc.arch.hidden_size
    mtp = [(f"model.layers.{n}.eh_proj.weight", torch.randn(h, 2 * h)),
           (f"model.layers.{n}.enorm.weight", torch.randn(h)),
           (f"model.layers.{n}.shared_head.norm.weight", torch.randn(h)),
           (f"model.layers.{n}.mlp.experts.0.up_proj.weight", torch.randn(32, h)),
           (f"model.layers.{n}.self_attn.q_proj.weight", torch.randn(4 * 32, h))]
    plain = dict(hf_to_mcore(mc, iter(ckpt)))
    with_mtp = dict(hf_to_mcore(mc, iter([*mtp[:2], *ckpt, *mtp[2:]])))
    assert with_mtp.keys() == plain.keys()
    assert all(torch.equal(with_mtp[k], plain[k]) for k in plain)


def test_glm4_moe_lite_table_is_deepseek_v3s_names():
    """GLM-4.7-Flash (glm4_moe_lite): MLA with a query LoRA, a value head wider than the "nope" key
    part, a dense layer then routed experts behind a sigmoid router with its correction bias and a
    shared expert, all under DeepSeek-V3's HF names; the released 47 decoder layers end at 46."""
    mc = load_model_config("tiny-glm4-moe-lite")
    targets = M.default_targets(mc)
    assert M.resolve(mc, "decoder.layers.0.self_attention.linear_q_down_proj.weight").hf_names == (
        "model.layers.0.self_attn.q_a_proj.weight",)
    assert M.resolve(mc, "decoder.layers.1.self_attention.kv_layernorm.weight").hf_names == (
        "model.layers.1.self_attn.kv_a_layernorm.weight",)
    assert M.resolve(mc, "decoder.layers.0.mlp.linear_fc1.weight").hf_names == (
        "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight")
    assert "decoder.layers.0.mlp.router.weight" not in targets
    assert M.resolve(mc, "decoder.layers.1.mlp.router.expert_bias").hf_names == (
        "model.layers.1.mlp.gate.e_score_correction_bias",)
    assert "decoder.layers.1.mlp.shared_experts.linear_fc2.weight" in targets
    assert not any("linear_qkv" in n or n.endswith("linear_proj.bias") for n in targets)


def test_minimax_m2_table_shards_its_qk_norms_by_heads_and_names_experts_as_mixtral():
    """MiniMax-M2: the all-heads q/k norm weights are split over TP along dim 0 like linear_qkv (a
    rank's chunk is its heads' part: rank 1 of 2 holds q heads 2-3 and KV head 1), and the MoE is
    Mixtral's names (w1/w3 = gate/up, w2 = down) under block_sparse_moe, the correction bias beside
    the gate; no dense layer, no shared expert, no bias."""
    mc = load_model_config("tiny-minimax-m2")
    targets = M.default_targets(mc)
    for x, width in (("q", 4 * 32), ("k", 2 * 32)):
        name = f"decoder.layers.1.self_attention.{x}_layernorm.weight"
        assert targets[name] == 0 and M.resolve(mc, name).hf_names == (f"model.layers.1.self_attn.{x}_norm.weight",)
        full = torch.arange(width, dtype=torch.float32)
        parts = [dict(M.hf_to_mcore(mc, lambda n: full if n.endswith(f"{x}_norm.weight") else torch.zeros(1), r, 2,
                                    targets={name: 0}))[name] for r in (0, 1)]
        assert torch.equal(parts[1], full[width // 2:])
    assert M.resolve(mc, "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight").hf_names == (
        "model.layers.0.block_sparse_moe.experts.2.w1.weight", "model.layers.0.block_sparse_moe.experts.2.w3.weight")
    assert M.resolve(mc, "decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight").hf_names == (
        "model.layers.0.block_sparse_moe.experts.2.w2.weight",)
    assert M.resolve(mc, "decoder.layers.0.mlp.router.weight").hf_names == (
        "model.layers.0.block_sparse_moe.gate.weight",)
    assert M.resolve(mc, "decoder.layers.0.mlp.router.expert_bias").hf_names == (
        "model.layers.0.block_sparse_moe.e_score_correction_bias",)
    assert not any("shared_experts" in n or n.endswith(".bias") or "mlp.linear_fc" in n for n in targets)


def test_qwen3_next_gated_delta_net_tensors_split_over_tp_part_by_part():
    """Qwen3-Next's linear-attention layers: HF's in_proj_qkvz ([q, k, v, z] per key head) and in_proj_ba
    ([b, a] per key head) become megatron GatedDeltaNet's in_proj [q; k; v; z; b; a], and at TP 2 rank r
    holds [q_r; k_r; v_r; z_r; b_r; a_r] (megatron's forward splits its local rows that way), the conv1d
    [q_r; k_r; v_r]; the round trip is exact. tiny-qwen3-next: 2 key heads of 16, 4 value heads of 32."""
    mc = load_model_config("tiny-qwen3-next")
    h, qk, v, nv = 64, 2 * 16, 4 * 32, 4
    # every row of the HF tensors says which (part, head, row) it is, so the layout can be read back
    rows = []
    for g in range(2):  # key head g: q_g (16), k_g (16), v of value heads 2g, 2g+1 (2 x 32), z likewise
        rows += [("q", g, i) for i in range(16)] + [("k", g, i) for i in range(16)]
        rows += [("v", 2 * g + j, i) for j in range(2) for i in range(32)]
        rows += [("z", 2 * g + j, i) for j in range(2) for i in range(32)]
    ba_rows = [(x, 2 * g + j, 0) for g in range(2) for x in "ba" for j in range(2)]
    code = {r: float(n) for n, r in enumerate(rows + ba_rows)}
    qkvz = torch.tensor([code[r] for r in rows]).unsqueeze(1).expand(-1, h).contiguous()
    ba = torch.tensor([code[r] for r in ba_rows]).unsqueeze(1).expand(-1, h).contiguous()
    name = "decoder.layers.0.self_attention.in_proj.weight"
    res = M.resolve(mc, name)
    assert res.hf_names == ("model.layers.0.linear_attn.in_proj_qkvz.weight",
                            "model.layers.0.linear_attn.in_proj_ba.weight")
    src = {res.hf_names[0]: qkvz, res.hf_names[1]: ba}
    parts = [dict(M.hf_to_mcore(mc, src.__getitem__, r, 2, targets={name: 0}))[name] for r in (0, 1)]

    def want(rank):  # q, k of key head `rank`, then v, z of value heads 2 rank, 2 rank + 1, then b, a
        order = [("q", rank, i) for i in range(16)] + [("k", rank, i) for i in range(16)]
        for x in "vz":
            order += [(x, 2 * rank + j, i) for j in range(2) for i in range(32)]
        order += [(x, 2 * rank + j, 0) for x in "ba" for j in range(2)]
        return torch.tensor([code[r] for r in order])

    assert parts[0].shape == ((2 * qk + 2 * v + 2 * nv) // 2, h)
    assert torch.equal(parts[0][:, 0], want(0)) and torch.equal(parts[1][:, 0], want(1))
    full = M.unshard(res.rule.kind, parts, partition_dim=0, sections=res.rule.sections)
    back = M.to_hf(res.rule, full, M.Layout.of(mc))
    assert torch.equal(back[0], qkvz) and torch.equal(back[1], ba)
    conv = M.resolve(mc, "decoder.layers.1.self_attention.conv1d.weight")
    assert conv.hf_names == ("model.layers.1.linear_attn.conv1d.weight",) and conv.rule.sections == (qk, qk, v)
    w = torch.arange(2 * qk + v, dtype=torch.float32).view(-1, 1, 1)
    r1 = M.shard("plain", w, 1, 2, partition_dim=0, sections=conv.rule.sections)
    assert r1.flatten().tolist() == [*range(16, 32), *range(48, 64), *range(64 + 64, 64 + 128)]
    for x, hf in (("A_log", "A_log"), ("dt_bias", "dt_bias"), ("out_norm.weight", "norm.weight"),
                  ("out_proj.weight", "out_proj.weight")):
        assert M.resolve(mc, f"decoder.layers.1.self_attention.{x}").hf_names == (f"model.layers.1.linear_attn.{hf}",)
    # the TE spec fuses the input norm into in_proj
    assert M.resolve(mc, "decoder.layers.0.self_attention.in_proj.layer_norm_weight").hf_names == (
        "model.layers.0.input_layernorm.weight",)


def test_qwen3_next_gated_attention_shared_expert_and_mtp():
    """Qwen3-Next's full-attention layer (the third): q_proj [q_h; gate_h] per head goes into linear_qkv
    as [q heads, gate heads, k, v] per query group (megatron's attention_output_gate) and back; the MoE
    layers' shared expert (singular in HF) and its sigmoid gate; `mtp.*` never read. A leading dense layer
    (HF mlp_only_layers [0], which the mapping takes and SGLang's Qwen3-Next does not build: invented here,
    tiny-qwen3-next is all MoE as the release) maps to the dense MLP's names."""
    mc = load_model_config("tiny-qwen3-next")
    heads, groups, d, h = 4, 2, 32, 64
    q = torch.randn(heads * 2 * d, h)
    k, v = torch.randn(groups * d, h), torch.randn(groups * d, h)
    fused = M.fuse_qkv(q, k, v, groups, output_gate=True)
    per_head = q.view(heads, 2, d, h)
    g0 = fused.view(groups, -1, h)[0]  # group 0: q heads 0-1, gate heads 0-1, k_0, v_0
    assert torch.equal(g0[:d], per_head[0, 0]) and torch.equal(g0[d:2 * d], per_head[1, 0])
    assert torch.equal(g0[2 * d:3 * d], per_head[0, 1]) and torch.equal(g0[4 * d:5 * d], k[:d])
    assert all(torch.equal(a, b) for a, b in zip(M.split_qkv(fused, groups, heads, d, output_gate=True), (q, k, v)))
    res = M.resolve(mc, "decoder.layers.2.self_attention.linear_qkv.weight")
    assert res.hf_names == tuple(f"model.layers.2.self_attn.{x}_proj.weight" for x in "qkv")
    assert M.Layout.of(mc).output_gate
    targets = M.default_targets(mc)
    assert "decoder.layers.2.self_attention.q_layernorm.weight" in targets
    assert not any(n.startswith("decoder.layers.2.self_attention.in_proj") for n in targets)
    assert not any(n.startswith("decoder.layers.0.self_attention.linear_qkv") for n in targets)
    assert M.resolve(mc, "decoder.layers.1.mlp.shared_experts.gate_weight").hf_names == (
        "model.layers.1.mlp.shared_expert_gate.weight",)
    assert M.resolve(mc, "decoder.layers.1.mlp.shared_experts.linear_fc1.weight").hf_names == (
        "model.layers.1.mlp.shared_expert.gate_proj.weight", "model.layers.1.mlp.shared_expert.up_proj.weight")
    assert "decoder.layers.0.mlp.router.weight" in targets and "decoder.layers.0.mlp.linear_fc1.weight" not in targets
    dense0 = mc.model_copy(update={"arch": mc.arch.model_copy(update={
        "moe": mc.arch.moe.model_copy(update={"first_k_dense": 1})})})
    assert M.resolve(dense0, "decoder.layers.0.mlp.linear_fc1.weight").hf_names == (
        "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight")
    dense0_targets = M.default_targets(dense0)
    assert "decoder.layers.0.mlp.router.weight" not in dense0_targets
    assert "decoder.layers.1.mlp.router.weight" in dense0_targets
    assert not any(n.startswith("mtp.") for n in M.expected_hf_names(mc))


def test_qwen3_5_is_qwen3_next_under_the_language_model_with_a_split_in_proj():
    """Qwen3.5's language model: every HF name under model.language_model. (lm_head stays lm_head);
    the gated delta net's in_proj_qkv ([q; k; v] over all heads), in_proj_z, in_proj_b, in_proj_a are
    concatenated into megatron's in_proj [q; k; v; z; b; a] and split over TP part by part; dense MLPs."""
    mc = load_model_config("tiny-qwen3.5")
    qk, v, nv, h = 32, 128, 4, 64
    res = M.resolve(mc, "decoder.layers.0.self_attention.in_proj.weight")
    la = "model.language_model.layers.0.linear_attn."
    assert res.hf_names == tuple(la + f"in_proj_{x}.weight" for x in ("qkv", "z", "b", "a"))
    hf = [torch.randn(n, h) for n in (2 * qk + v, v, nv, nv)]
    full = M.to_mcore(res.rule, hf, M.Layout.of(mc))
    q, k, vv, z, b, a = torch.split(full, [qk, qk, v, v, nv, nv])
    r1 = M.shard(res.rule.kind, full, 1, 2, partition_dim=0, sections=res.rule.sections)
    assert torch.equal(r1, torch.cat([x.chunk(2)[1] for x in (q, k, vv, z, b, a)]))
    parts = [M.shard(res.rule.kind, full, r, 2, partition_dim=0, sections=res.rule.sections) for r in (0, 1)]
    back = M.to_hf(res.rule, M.unshard(res.rule.kind, parts, partition_dim=0, sections=res.rule.sections),
                   M.Layout.of(mc))
    assert all(torch.equal(x, y) for x, y in zip(back, hf))
    assert M.resolve(mc, "embedding.word_embeddings.weight").hf_names == ("model.language_model.embed_tokens.weight",)
    assert M.resolve(mc, "decoder.final_layernorm.weight").hf_names == ("model.language_model.norm.weight",)
    assert M.resolve(mc, "output_layer.weight").hf_names == ("lm_head.weight",)
    assert M.resolve(mc, "decoder.layers.2.self_attention.linear_qkv.weight").hf_names == tuple(
        f"model.language_model.layers.2.self_attn.{x}_proj.weight" for x in "qkv")
    names = M.expected_hf_names(mc)
    assert all(n.startswith("model.language_model.") or n == "lm_head.weight" for n in names)
    assert not any("router" in n or "experts" in n for n in M.default_targets(mc))


def test_qwen3_5_moe_is_qwen3_next_moe_under_the_language_model():
    """Qwen3.5 MoE: Qwen3.5's layers with Qwen3-Next's MoE block in every layer, experts per expert under
    model.language_model. (as transformers 5.19 writes them), the shared expert and its gate."""
    mc = load_model_config("tiny-qwen3.5-moe")
    p = "model.language_model.layers.0.mlp."
    assert M.resolve(mc, "decoder.layers.0.mlp.router.weight").hf_names == (p + "gate.weight",)
    assert M.resolve(mc, "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight").hf_names == (
        p + "experts.3.gate_proj.weight", p + "experts.3.up_proj.weight")
    assert M.resolve(mc, "decoder.layers.0.mlp.shared_experts.gate_weight").hf_names == (
        p + "shared_expert_gate.weight",)
    assert M.resolve(mc, "decoder.layers.0.self_attention.in_proj.weight").rule.kind == "concat"
    assert not any(".mlp.linear_fc" in n for n in M.default_targets(mc))  # no dense layer


def test_mimo_reads_and_exports_no_mtp_tensor(tiny_ckpts):
    """MiMo: the Qwen2 tables; the MTP layer's 16 tensors in the file (`model.mtp_layers.0.*`) are
    not read by the streamed import (same tensors with or without them) and not in the export set."""
    mc = load_model_config("tiny-mimo")
    ckpt = HFCheckpoint(tiny_ckpts / "tiny-mimo")
    mtp = [n for n in ckpt.names() if n.startswith("model.mtp_layers.")]
    assert len(mtp) == 16 and not any(n.startswith("model.mtp_layers.") for n in M.expected_hf_names(mc))
    qwen2 = load_model_config("tiny-qwen2")
    assert {r.mcore for r in M.layer_rules(mc, 0)} == {r.mcore for r in M.layer_rules(qwen2, 0)}
    with_mtp = dict(hf_to_mcore(mc, iter(ckpt)))
    without = dict(hf_to_mcore(mc, ((n, t) for n, t in ckpt if n not in mtp)))
    assert with_mtp.keys() == without.keys() and all(torch.equal(with_mtp[k], without[k]) for k in without)


def test_moonlight_table_projects_queries_without_lora():
    """Moonlight (deepseek_v3, q_lora_rank null): one q_proj as linear_q_proj, no q LoRA or its
    norm; two shared experts are one shared MLP of twice the width."""
    mc = load_model_config("tiny-moonlight")
    targets = M.default_targets(mc)
    res = M.resolve(mc, "decoder.layers.0.self_attention.linear_q_proj.weight")
    assert res.hf_names == ("model.layers.0.self_attn.q_proj.weight",) and res.rule.tp_dim == 0
    assert not any("q_down_proj" in n or "q_up_proj" in n or "q_layernorm" in n for n in targets)
    assert "decoder.layers.1.self_attention.kv_layernorm.weight" in targets
    names = set(M.expected_hf_names(load_model_config("moonlight-16B-A3B")))
    assert "model.layers.26.self_attn.q_proj.weight" in names
    assert "model.layers.26.mlp.experts.63.gate_proj.weight" in names
    assert not any("q_a_proj" in n for n in names)


def test_missing_tensor_is_named(tiny_ckpts):
    mc = load_model_config("tiny-qwen3")
    ckpt = HFCheckpoint(tiny_ckpts / "tiny-qwen3")
    stream = ((n, t) for n, t in ckpt if n != "model.layers.1.self_attn.k_proj.weight")
    with pytest.raises(Exception, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        list(hf_to_mcore(mc, stream))


def test_te_parameter_names_resolve_to_the_same_rules():
    mc = load_model_config("tiny-qwen3")
    local = M.resolve(mc, "decoder.layers.1.input_layernorm.weight")
    te = M.resolve(mc, "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight")
    assert local.hf_names == te.hf_names == ("model.layers.1.input_layernorm.weight",)


def test_expert_names_use_the_ep_offset():
    mc = load_model_config("tiny-qwen3-moe")
    res = M.resolve(mc, "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight", expert_offset=2)
    assert res.hf_names == ("model.layers.0.mlp.experts.3.down_proj.weight",)
    res = M.resolve(mc, "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight",
                    layer_map=lambda i: i + 1)
    assert res.hf_names == ("model.layers.1.mlp.experts.1.down_proj.weight",)


def test_glm_moe_dsa_table_adds_the_indexer_to_deepseek_v3s_names(tiny_ckpts):
    """GLM-5 (glm_moe_dsa): GLM-4.7-Flash's MLA/MoE names plus, in every layer with an indexer, its 5
    tensors under megatron's DSAttention (`core_attention.indexer.*`), replicated over TP and
    unpermuted (rlslurm's indexer rotates the leading rope dims, as transformers does); none in
    GLM-5.2's shared layer 2; the MTP layer a release appends (`model.layers.{num_layers}.*`, indexer
    included) is never read."""
    mc = load_model_config("tiny-glm-moe-dsa")
    targets = M.default_targets(mc)
    pairs = {"linear_wq_b.weight": "wq_b.weight", "linear_wk.weight": "wk.weight", "k_norm.weight": "k_norm.weight",
             "k_norm.bias": "k_norm.bias", "linear_weights_proj.weight": "weights_proj.weight"}
    for layer in (0, 1):
        for ours, hf in pairs.items():
            name = f"decoder.layers.{layer}.self_attention.core_attention.indexer.{ours}"
            assert targets[name] is None and M.resolve(mc, name).hf_names == (
                f"model.layers.{layer}.self_attn.indexer.{hf}",)
    assert M.resolve(mc, "decoder.layers.1.mlp.router.expert_bias").hf_names == (
        "model.layers.1.mlp.gate.e_score_correction_bias",)
    lite = {r.mcore for r in M.layer_rules(load_model_config("tiny-glm4-moe-lite"), 1)}
    indexer = {"self_attention.core_attention.indexer." + n for n in pairs}
    assert {r.mcore for r in M.layer_rules(mc, 1)} - lite == indexer
    assert mc.arch.dsa.shared_layers == (2,) and {r.mcore for r in M.layer_rules(mc, 2)} == lite
    assert not any(".indexer." in n for n in M.expected_hf_names(mc) if n.startswith("model.layers.2."))
    ckpt = HFCheckpoint(tiny_ckpts / "tiny-glm-moe-dsa")
    n, h = mc.arch.num_layers, mc.arch.hidden_size
    mtp = [(f"model.layers.{n}.eh_proj.weight", torch.randn(h, 2 * h)),
           (f"model.layers.{n}.self_attn.indexer.wk.weight", torch.randn(32, h))]
    plain = dict(hf_to_mcore(mc, iter(ckpt)))
    with_mtp = dict(hf_to_mcore(mc, iter([mtp[0], *ckpt, mtp[1]])))
    assert with_mtp.keys() == plain.keys() and all(torch.equal(with_mtp[k], plain[k]) for k in plain)


def test_glm_moe_dsa_tiny_model_is_really_sparse(tiny_ckpts):
    """The parity tests' input (2 rows of 12 tokens, parity_worker.py) is longer than tiny-glm-moe-dsa's
    index_topk (4): transformers' logits change once every query may attend to all its keys (top-k
    larger than the row), from the 5th position on, and not before (a query there has at most 4 keys).
    Layers 0 and 1 keep different keys for some queries, so layer 2 (shared) reusing the wrong one shows."""
    from transformers import AutoModelForCausalLM

    mc = load_model_config("tiny-glm-moe-dsa")
    hf = AutoModelForCausalLM.from_pretrained(tiny_ckpts / "tiny-glm-moe-dsa", dtype=torch.float32).eval()
    ids = torch.randint(4, mc.arch.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    kept: dict[int, list] = {0: [], 1: []}
    for i in (0, 1):
        def keep(*a, _run=hf.model.layers[i].self_attn.indexer.forward, _i=i, **k):
            kept[_i].append(_run(*a, **k))
            return kept[_i][-1]
        hf.model.layers[i].self_attn.indexer.forward = keep
    assert hf.model.layers[2].self_attn.indexer is None  # shared: reuses layer 1's top-k
    with torch.no_grad():
        sparse = hf(ids).logits
        for layer in hf.model.layers[:2]:
            assert layer.self_attn.indexer.index_topk == mc.arch.dsa.index_topk == 4
            layer.self_attn.indexer.index_topk = 10**6
        dense = hf(ids).logits
    diff = (sparse - dense).abs()
    assert float(diff[:, :4].max()) < 1e-6 and float(diff[:, 4:].max()) > 1e-2  # (the former: rounding)
    assert not torch.equal(kept[0][0].sort(-1).values, kept[1][0].sort(-1).values)
