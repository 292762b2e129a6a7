"""Every tiny-* model config is one the GPU stack's SGLang (0.5.14, CUDA, bf16, the bundle's triton
attention) can serve: its shapes fit the CUDA kernels SGLang picks for the family and its config.json
(rlslurm.tiny) carries every key SGLang reads there. CI has no GPU, so the constraints are written
down here as read off SGLang 0.5.14's code (each cites its file; docs/model-families.md, "What SGLang
0.5.14 serves on a GPU", has the list and what a GPU run showed). A new tiny config or family that
breaks one fails here instead of in the GPU tier. Checked on an H100 (tools/gpu/family_engines.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from rlslurm.settings.model_config import ModelConfig, available_models, load_model_config
from rlslurm.tiny import hf_config_dict

TINY = [n for n in available_models() if n.startswith("tiny-")]
MLA = ("deepseek_v3", "glm4_moe_lite", "glm_moe_dsa")
GATED_DELTA = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _text(cfg: dict) -> dict:
    return cfg.get("text_config", cfg)


def rope_kv_store(mc: ModelConfig, cfg: dict) -> list[str]:
    """models/qwen3_moe.py passes the KV-cache store to its rotary kernel (create_fused_set_kv_buffer_arg:
    CUDA, bf16 KV cache, plain rope); layers/rotary_embedding/base.py takes the fused kernel only for a
    head size of 64, 128, 256 or 512, and the fallback asserts "save kv cache is not supported";
    jit_kernel/csrc/elementwise/rope.cuh's store path needs the rotary dims to be the whole head."""
    a = mc.arch
    if mc.hf_model_type != "qwen3_moe":
        return []
    bad = []
    if a.kv_channels not in (64, 128, 256, 512):
        bad.append(f"head size {a.kv_channels} not in (64, 128, 256, 512)")
    if a.rotary_percent != 1.0:
        bad.append(f"rotary over {a.rotary_percent} of the head, not all of it")
    return bad


def mla_triton_decode(mc: ModelConfig, cfg: dict) -> list[str]:
    """layers/attention/triton_ops/decode_attention.py _decode_grouped_att_m_fwd: MLA decode reads V from
    the K tile (`v = tl.trans(k)`), so the tile of kv_lora_rank + rope dims must be as wide as the
    V tile of kv_lora_rank (next powers of 2), unless it is 576 = 512 + 64 or 288 = 256 + 32."""
    if mc.hf_model_type not in MLA:
        return []
    r, rope = mc.arch.mla.kv_lora_rank, mc.arch.mla.qk_pos_emb_head_dim
    if (r, rope) in ((512, 64), (256, 32)) or _next_pow2(r + rope) == _next_pow2(r):
        return []
    return [f"kv_lora_rank {r} + rope {rope}: a K tile of {_next_pow2(r + rope)} against a V tile of {_next_pow2(r)}"]


def mla_value_heads(mc: ModelConfig, cfg: dict) -> list[str]:
    """Observed, not read off the code: on an H100 (bench/results/gpu-lease-2026-12-07.md) every MLA tiny
    config with value heads of 16 died of an illegal memory access at its first prefill (the triton extend
    attention of the MHA path, layers/attention/triton_ops/extend_attention.py, whose V tile is the next
    power of 2 of v_head_dim), tiny-glm4-moe-lite with 16 as well, and each served with 24. Released MLA
    models have 128 or more."""
    if mc.hf_model_type not in MLA or _next_pow2(mc.arch.mla.v_head_dim) >= 32:
        return []
    return [f"v_head_dim {mc.arch.mla.v_head_dim}: a V tile of {_next_pow2(mc.arch.mla.v_head_dim)}, below 32"]


def dsa_index_head(mc: ModelConfig, cfg: dict) -> list[str]:
    """mem_cache/memory_pool.py DSATokenToKVPool: `assert index_head_dim == 128`."""
    d = mc.arch.dsa
    return [] if d is None or d.index_head_dim == 128 else [f"index_head_dim {d.index_head_dim}, not 128"]


def gdn_split_kernel(mc: ModelConfig, cfg: dict) -> list[str]:
    """jit_kernel/triton/gdn_fused_proj.py (models/qwen3_next.py and qwen3_5.py call it on CUDA when the
    value heads per key head are 1, 2 or 4): `tl.arange` over a key head and over a key head's value
    heads, which Triton takes only for powers of 2."""
    d = mc.arch.gated_delta_net
    if mc.hf_model_type not in GATED_DELTA or d.num_value_heads // d.num_key_heads not in (1, 2, 4):
        return []
    per_key = d.num_value_heads // d.num_key_heads * d.value_head_dim
    return [f"{what} {n} is not a power of 2" for what, n in
            (("key head dim", d.key_head_dim), ("value dims per key head", per_key)) if not _pow2(n)]


def qwen3_next_all_moe(mc: ModelConfig, cfg: dict) -> list[str]:
    """models/qwen3_next.py builds every layer's MLP as its sparse MoE block (`is_layer_sparse = True`),
    whatever mlp_only_layers says: a dense layer's weights would have no home there."""
    if mc.hf_model_type != "qwen3_next" or mc.arch.moe is None or mc.arch.moe.first_k_dense == 0:
        return []
    return [f"{mc.arch.moe.first_k_dense} leading dense layer(s)"]


def config_keys(mc: ModelConfig, cfg: dict) -> list[str]:
    """Keys SGLang 0.5.14 reads from the config without a default that transformers 5.8.1's config class
    does not supply: models/deepseek_v2.py (DeepSeek-V3, and GLM-5 built on it) reads moe_layer_freq,
    topk_method and scoring_func; configs/qwen3_next.py builds the layer list from
    full_attention_interval (Qwen3.5's text config is that class)."""
    need = {"deepseek_v3": ("moe_layer_freq", "topk_method", "scoring_func"),
            "glm_moe_dsa": ("moe_layer_freq", "topk_method", "scoring_func"),
            "qwen3_next": ("full_attention_interval",), "qwen3_5": ("full_attention_interval",),
            "qwen3_5_moe": ("full_attention_interval",)}.get(mc.hf_model_type, ())
    text = _text(cfg)
    return [f"config.json has no {k}" for k in need if k not in text]


def dsa_shared_layers(mc: ModelConfig, cfg: dict) -> list[str]:
    """configs/model_config.py dsa_layer_skips_topk: 0.5.14 knows the layers that reuse the previous
    top-k only as index_topk_pattern ("S"); without it every layer runs an indexer, which the checkpoint
    does not hold for GLM-5.2's shared layers (0.5.23 reads indexer_types first)."""
    d = mc.arch.dsa
    if d is None:
        return []
    pattern = cfg.get("index_topk_pattern", "")
    shared = [i for i, c in enumerate(pattern) if c == "S"]
    return [] if shared == list(d.shared_layers) and len(pattern) == mc.arch.num_layers else [
        f"index_topk_pattern {pattern!r} does not mark shared layers {list(d.shared_layers)}"]


CONSTRAINTS: list[Callable[[ModelConfig, dict], list[str]]] = [
    rope_kv_store, mla_triton_decode, mla_value_heads, dsa_index_head, gdn_split_kernel, qwen3_next_all_moe,
    config_keys, dsa_shared_layers]


@pytest.mark.parametrize("name", TINY)
def test_the_gpu_stacks_sglang_can_serve_it(name: str) -> None:
    mc = load_model_config(name)
    cfg = hf_config_dict(mc)
    broken = {c.__name__: why for c in CONSTRAINTS if (why := c(mc, cfg))}
    assert not broken, f"{name}: {broken}"


def test_the_constraints_catch_what_the_gpu_refused() -> None:
    """The shapes the first GPU runs of the tiny configs died on, each caught by its constraint."""
    def variant(name: str, **arch) -> ModelConfig:
        mc = load_model_config(name)
        a = mc.arch
        for field, upd in arch.items():
            sub = getattr(a, field)
            a = a.model_copy(update={field: sub.model_copy(update=upd) if isinstance(upd, dict) else upd})
        return mc.model_copy(update={"arch": a})

    qwen3_moe = variant("tiny-qwen3-moe", kv_channels=16)
    assert rope_kv_store(qwen3_moe, hf_config_dict(qwen3_moe)) == ["head size 16 not in (64, 128, 256, 512)"]
    ds = variant("tiny-deepseek-v3", mla={"kv_lora_rank": 32})
    assert mla_triton_decode(ds, {}) == ["kv_lora_rank 32 + rope 8: a K tile of 64 against a V tile of 32"]
    deepseek_sizes = variant("tiny-deepseek-v3", mla={"kv_lora_rank": 512, "qk_pos_emb_head_dim": 64})
    assert mla_triton_decode(deepseek_sizes, {}) == []
    for name in ("tiny-deepseek-v3", "tiny-moonlight", "tiny-glm4-moe-lite"):  # each died on the H100 with 16
        assert mla_value_heads(variant(name, mla={"v_head_dim": 16}), {}) == ["v_head_dim 16: a V tile of 16, below 32"]
    nxt = variant("tiny-qwen3-next", gated_delta_net={"value_head_dim": 24})
    assert gdn_split_kernel(nxt, {}) == ["value dims per key head 48 is not a power of 2"]
    dense0 = variant("tiny-qwen3-next", moe={"first_k_dense": 1})
    assert qwen3_next_all_moe(dense0, {}) == ["1 leading dense layer(s)"]
    assert dsa_index_head(variant("tiny-glm-moe-dsa", dsa={"index_head_dim": 32}), {}) == ["index_head_dim 32, not 128"]
    ds_cfg = {k: v for k, v in hf_config_dict(load_model_config("tiny-deepseek-v3")).items() if k != "moe_layer_freq"}
    assert config_keys(load_model_config("tiny-deepseek-v3"), ds_cfg) == ["config.json has no moe_layer_freq"]


def test_what_the_checkpoint_carries_for_the_engine(tmp_path: Path) -> None:
    """Beside the weights: MiMo's config class (its config.json names remote code; SGLang reads it with
    --trust-remote-code) and Qwen3.5's image processor config (SGLang loads the multimodal processor
    at start, and refused the directory without it)."""
    from transformers import AutoConfig

    from rlslurm.tiny import make_tiny_checkpoint

    mimo = make_tiny_checkpoint(load_model_config("tiny-mimo"), tmp_path / "mimo")
    cfg = AutoConfig.from_pretrained(mimo, trust_remote_code=True)
    assert (type(cfg).__name__, cfg.model_type, cfg.num_nextn_predict_layers, cfg.num_key_value_heads) == (
        "MiMoConfig", "mimo", 1, 2)
    q35 = make_tiny_checkpoint(load_model_config("tiny-qwen3.5"), tmp_path / "q35")
    pre = json.loads((q35 / "preprocessor_config.json").read_text())
    assert pre["image_processor_type"].startswith("Qwen2VLImageProcessor") and pre["patch_size"] == 16
    assert json.loads((q35 / "config.json").read_text())["vision_config"]["patch_size"] == pre["patch_size"]
