"""rlslurm.models.build: TransformerConfig from a model config and --megatron-* overrides."""

from __future__ import annotations

import pytest
import torch

from rlslurm.errors import ConfigError
from rlslurm.settings.model_config import load_model_config

pytestmark = pytest.mark.megatron


def test_arch_numbers_reach_the_transformer_config():
    from rlslurm.models.build import transformer_config

    mc = load_model_config("tiny-glm4")
    cfg = transformer_config(mc, params_dtype=torch.bfloat16, tp=2, pp=1, ep=1, cp=1, overrides={})
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_query_groups, cfg.kv_channels) == (2, 64, 2, 16)
    assert cfg.add_qkv_bias and cfg.rotary_interleaved and cfg.gated_linear_unit
    assert cfg.tensor_model_parallel_size == 2 and cfg.bf16 and cfg.params_dtype == torch.bfloat16
    assert cfg.layernorm_epsilon == 1e-5 and cfg.normalization == "RMSNorm"


def test_qwen2_has_qkv_bias_only_and_ties_embeddings():
    from rlslurm.models.build import transformer_config

    mc = load_model_config("tiny-qwen2")
    cfg = transformer_config(mc, tp=2, overrides={})
    assert cfg.add_qkv_bias and not cfg.add_bias_linear and not cfg.qk_layernorm
    assert cfg.layernorm_epsilon == 1e-6 and mc.arch.rotary_base == 1e6 and mc.arch.tie_word_embeddings
    assert not load_model_config("qwen2.5-7B").arch.tie_word_embeddings


def test_moe_and_mla_fields():
    from rlslurm.models.build import transformer_config

    ds = transformer_config(load_model_config("tiny-deepseek-v3"), overrides={})
    assert type(ds).__name__ == "MLATransformerConfig"
    assert (ds.q_lora_rank, ds.kv_lora_rank, ds.qk_head_dim, ds.qk_pos_emb_head_dim) == (32, 24, 16, 8)
    assert ds.moe_layer_freq == [0, 1] and ds.moe_router_score_function == "sigmoid"
    assert ds.moe_router_topk_scaling_factor == 2.5 and ds.moe_router_enable_expert_bias
    assert (ds.moe_router_num_groups, ds.moe_router_group_topk) == (2, 1)
    mc = load_model_config("tiny-qwen3-moe")
    q = transformer_config(mc, overrides={})
    assert q.moe_router_pre_softmax is False  # norm_topk_prob=True = softmax over the top-k logits
    no_norm = mc.model_copy(update={"arch": mc.arch.model_copy(
        update={"moe": mc.arch.moe.model_copy(update={"router_topk_norm": False})})})
    assert transformer_config(no_norm, overrides={}).moe_router_pre_softmax is True


def test_glm4_moe_fields():
    from rlslurm.models.build import transformer_config

    cfg = transformer_config(load_model_config("tiny-glm4-moe"), tp=2, overrides={})
    assert type(cfg).__name__ == "TransformerConfig" and not cfg.multi_latent_attention
    assert cfg.add_qkv_bias and not cfg.add_bias_linear and cfg.qk_layernorm and not cfg.rotary_interleaved
    assert cfg.kv_channels == 32 and cfg.hidden_size == 64  # head dim wider than hidden / heads
    assert cfg.moe_layer_freq == [0, 1] and cfg.moe_router_score_function == "sigmoid"
    assert cfg.moe_router_enable_expert_bias and cfg.moe_router_bias_update_rate == 0.0
    assert cfg.moe_router_topk_scaling_factor == 2.5 and cfg.moe_router_num_groups is None
    assert cfg.moe_shared_expert_intermediate_size == 32 and cfg.sequence_parallel
    air = transformer_config(load_model_config("glm4.5-air"), overrides={})
    assert not air.qk_layernorm and air.moe_router_topk_scaling_factor is None  # routed_scaling_factor 1.0
    assert air.moe_layer_freq == [0] + [1] * 45 and air.moe_shared_expert_intermediate_size == 1408
    # the correction bias stays the checkpoint's unless asked
    assert transformer_config(load_model_config("tiny-glm4-moe"), overrides={"moe_router_bias_update_rate": 1e-3}
                              ).moe_router_bias_update_rate == 1e-3
    moon = transformer_config(load_model_config("moonlight-16B-A3B"), overrides={})
    assert moon.q_lora_rank is None and moon.moe_shared_expert_intermediate_size == 2816
    assert moon.moe_router_topk_scaling_factor == 2.446 and moon.moe_router_bias_update_rate == 0.0


@pytest.mark.parametrize("changes,match", [
    ({"router_num_groups": 4, "router_group_topk": 2, "router_topk": 8}, "router_group_topk=2 with router_topk=8"),
    ({"router_topk": 1}, "router_topk=1 with sigmoid scores"),
])
def test_routing_megatron_computes_differently_is_refused_at_load(tmp_path, changes, match):
    import yaml

    from rlslurm.settings.model_config import MODEL_CONFIG_DIR

    raw = yaml.safe_load((MODEL_CONFIG_DIR / "tiny-glm4-moe.yaml").read_text())
    raw["arch"]["moe"].update(changes, num_experts=8)
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as e:
        load_model_config(str(path))
    assert match in str(e.value) and "arch.moe" in str(e.value) and "\n" not in str(e.value)


def test_overrides_apply_and_unknown_fields_name_the_flag():
    from rlslurm.models.build import transformer_config

    mc = load_model_config("tiny-qwen3")
    assert transformer_config(mc, overrides={"hidden_dropout": 0.1}).hidden_dropout == 0.1
    with pytest.raises(ConfigError, match="--megatron-hiden-dropout"):
        transformer_config(mc, overrides={"hiden_dropout": 0.1})


def test_minimax_m2_fields_and_the_tp_its_qk_norm_refuses():
    """MiniMax-M2: every layer MoE (sigmoid, correction bias, no shared expert, no scaling), partial
    non-interleaved rotary, and megatron's own per-head qk_layernorm off (rlslurm's all-heads norm
    takes its place in the layer spec, and finalize_model_grads must not sum its TP-sharded weight's
    gradient by name). TP above the 2 KV heads cannot split the k norm by whole heads: one line."""
    from rlslurm.models.build import transformer_config

    mc = load_model_config("tiny-minimax-m2")
    cfg = transformer_config(mc, tp=2, overrides={})
    assert mc.arch.qk_layernorm and mc.arch.qk_layernorm_all_heads and not cfg.qk_layernorm
    assert not cfg.add_qkv_bias and not cfg.add_bias_linear and not cfg.rotary_interleaved
    assert cfg.moe_layer_freq == [1, 1] and cfg.moe_router_score_function == "sigmoid"
    assert cfg.moe_router_enable_expert_bias and cfg.moe_shared_expert_intermediate_size is None
    assert cfg.moe_router_topk_scaling_factor is None and cfg.moe_router_num_groups is None
    with pytest.raises(ConfigError) as e:
        transformer_config(mc, tp=4, overrides={})
    assert str(e.value) == ("--tensor-model-parallel-size 4: tiny-minimax-m2's all-heads q/k norm is split over TP "
                            "by whole heads, and 2 KV heads / 4 query heads do not split into 4")


def test_qwen3_next_fields_and_what_its_gated_delta_net_refuses():
    """Qwen3-Next: megatron's gated delta net variant every layer but each 3rd (linear_attention_freq 3,
    HF's full_attention_interval), zero-centred norms, the attention output gate, the shared expert's
    gate, and sequence parallelism at TP 2 (the delta net's output norm sums its gradient over TP as a
    sequence-parallel weight). TP that does not split the linear heads: one line. At CP 2 the variant
    field stays unset (megatron asserts CP 1 for its own forward; rlslurm's subclass does CP) and the
    layer sizes are kept."""
    from rlslurm.models.build import transformer_config

    mc = load_model_config("tiny-qwen3-next")
    cfg = transformer_config(mc, tp=2, overrides={})
    assert cfg.experimental_attention_variant == "gated_delta_net" and cfg.linear_attention_freq == 3
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
            cfg.linear_conv_kernel_dim) == (2, 4, 16, 32, 4)
    assert cfg.layernorm_zero_centered_gamma and cfg.attention_output_gate and cfg.qk_layernorm
    assert cfg.moe_shared_expert_gate and cfg.moe_shared_expert_intermediate_size == 48
    assert cfg.moe_layer_freq == [1, 1, 1] and cfg.moe_router_score_function == "softmax"
    assert not cfg.moe_router_pre_softmax and cfg.sequence_parallel
    with pytest.raises(ConfigError) as e:
        transformer_config(mc, tp=4, overrides={})
    assert str(e.value) == ("--tensor-model-parallel-size 4: tiny-qwen3-next's gated delta net layers have 2 key / "
                            "4 value heads, which do not split into 4")
    with pytest.raises(ConfigError, match=r"^--megatron-sequence-parallel: gated delta nets at TP > 1 need"):
        transformer_config(mc, tp=2, overrides={"sequence_parallel": False})
    cp2 = transformer_config(mc, cp=2, overrides={})
    assert cp2.experimental_attention_variant is None and cp2.linear_attention_freq == 3
    assert (cp2.linear_num_key_heads, cp2.linear_num_value_heads) == (2, 4)


def test_qwen3_next_layer_spec_puts_gated_delta_nets_where_hf_does(monkeypatch):
    """Layers 0 and 1 (0-based) of tiny-qwen3-next are linear attention: megatron's GatedDeltaNet (rlslurm's
    subclass of it, which adds context parallelism) with rlslurm's kernels and output norm; layer 2 is
    megatron's SelfAttention with zero-centred q/k norms.
    Packed sequences (--qkv-format thd) are refused in one line."""
    from megatron.core import parallel_state as ps
    from megatron.core.ssm import gated_delta_net as gdn
    from megatron.core.transformer.attention import SelfAttention

    from rlslurm.models import gated_delta
    from rlslurm.models.build import layer_specs, transformer_config
    from rlslurm.models.specs import TorchNorm

    mc = load_model_config("tiny-qwen3-next")
    tcfg = transformer_config(mc, overrides={})
    with pytest.raises(ConfigError, match=r"^--qkv-format thd: tiny-qwen3-next's gated delta net layers take no "
                                          r"packed sequences"):
        layer_specs(mc, tcfg, packed=True)
    # one pipeline stage without process groups
    monkeypatch.setattr(ps, "get_pipeline_model_parallel_rank", lambda *a, **k: 0)
    monkeypatch.setattr(ps, "get_pipeline_model_parallel_world_size", lambda *a, **k: 1)
    block = layer_specs(mc, tcfg)
    kinds = [spec.submodules.self_attention.module for spec in block.layer_specs]
    assert issubclass(kinds[0], gdn.GatedDeltaNet) and kinds[1] is kinds[0] and kinds[2] is SelfAttention
    assert block.layer_specs[0].submodules.self_attention.submodules.out_norm is gated_delta.GatedOutputNorm
    assert gdn.HAVE_FLA and gdn.chunk_gated_delta_rule is gated_delta.chunk_gated_delta_rule
    # the local spec (--transformer-impl's default) whether transformer-engine imports or not
    assert tcfg.transformer_impl == "local"
    assert block.layer_specs[2].submodules.self_attention.submodules.q_layernorm is TorchNorm
    norm = TorchNorm(tcfg, 8, eps=1e-6)
    assert isinstance(norm, gated_delta.ZeroCenteredRMSNorm) and not norm.weight.any()


def test_unsupported_rope_scaling_is_refused():
    from rlslurm.models.build import transformer_config

    mc = load_model_config("tiny-llama")
    raw = mc.model_dump()
    raw["arch"]["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    bad = type(mc).model_validate(raw)
    with pytest.raises(ConfigError, match="rope_scaling"):
        transformer_config(bad, overrides={})


def test_sequence_parallel_where_megatron_needs_it():
    from rlslurm.models.build import transformer_config

    assert transformer_config(load_model_config("tiny-qwen3-moe"), tp=2, overrides={}).sequence_parallel
    assert transformer_config(load_model_config("tiny-deepseek-v3"), tp=2, overrides={}).sequence_parallel
    assert not transformer_config(load_model_config("tiny-qwen3"), tp=2, overrides={}).sequence_parallel
    assert not transformer_config(load_model_config("tiny-qwen3-moe"), tp=1, overrides={}).sequence_parallel
    with pytest.raises(ConfigError, match="--megatron-sequence-parallel"):
        transformer_config(load_model_config("tiny-deepseek-v3"), tp=2, overrides={"sequence_parallel": False})


def test_mask_padded_vocab_masks_exactly_the_padding_rows():
    from rlslurm.models.build import mask_padded_vocab, padded_vocab_size

    vpad = padded_vocab_size(64, 2)  # 256: 128 rows per TP rank
    logits = torch.zeros(1, 3, vpad // 2, requires_grad=True)
    r0 = mask_padded_vocab(logits, 64, tp_rank=0)
    assert torch.isfinite(r0[..., :64]).all() and torch.isinf(r0[..., 64:]).all()
    assert torch.isinf(mask_padded_vocab(logits, 64, tp_rank=1)).all()
    full = torch.zeros(1, 3, 128)
    assert mask_padded_vocab(full, 128, tp_rank=0) is full  # nothing padded: untouched
    r0.logsumexp(-1).sum().backward()  # differentiable; padding gets no gradient
    assert not logits.grad[..., 64:].any() and logits.grad[..., :64].all()


def test_glm_moe_dsa_fields_and_the_settings_its_sparse_attention_refuses():
    """GLM-5: MLA + MoE as GLM-4.7-Flash, plus megatron-core's DSA (experimental_attention_variant) with
    the indexer's sizes and its KL loss off, at CP 2 too; what it cannot take is refused in one line
    naming the flag (models/dsa.py, docs/model-families.md "GLM-5")."""
    from rlslurm.models.build import transformer_config

    mc = load_model_config("tiny-glm-moe-dsa")
    cfg = transformer_config(mc, tp=2, overrides={})
    assert type(cfg).__name__ == "MLATransformerConfig" and cfg.experimental_attention_variant == "dsa"
    assert (cfg.dsa_indexer_n_heads, cfg.dsa_indexer_head_dim, cfg.dsa_indexer_topk, cfg.dsa_indexer_loss_coeff) == (
        4, 128, 4, 0.0)
    assert (cfg.q_lora_rank, cfg.qk_pos_emb_head_dim, cfg.moe_layer_freq, cfg.moe_router_topk_scaling_factor) == (
        32, 8, [0, 1, 1], 2.5)
    assert cfg.sequence_parallel and not cfg.rotary_interleaved and cfg.moe_router_bias_update_rate == 0.0
    refusals = [
        ({"dsa_indexer_loss_coeff": 0.1}, {}, "--megatron-dsa-indexer-loss-coeff 0.1: rlslurm does not train "
                                              "tiny-glm-moe-dsa's sparse-attention indexer"),
        ({"recompute_granularity": "selective"}, {}, "--megatron-recompute-granularity selective: megatron-core "
                                                     "0.16's MLA recomputes core_attn without"),
    ]
    for overrides, kw, msg in refusals:
        with pytest.raises(ConfigError) as e:
            transformer_config(mc, overrides=overrides, **kw)
        assert str(e.value).startswith(msg) and "\n" not in str(e.value), str(e.value)
    # selective recompute of other modules leaves the sparse attention alone
    transformer_config(mc, overrides={"recompute_granularity": "selective", "recompute_modules": ["mlp"]})
    # CP: megatron-core 0.16 asserts CP 1 for DSA; rlslurm's GLM-5 attention takes it (models/dsa.py)
    cp2 = transformer_config(mc, cp=2, overrides={})
    assert cp2.context_parallel_size == 2 and cp2.experimental_attention_variant == "dsa"
    # GLM-5.2's shared layer 2 reuses layer 1's top-k: no pipeline stage may start with it
    for pp_kw, msg in (({"pp": 3}, "--pipeline-model-parallel-size 3: the stage starting at layer 2 of "
                                   "tiny-glm-moe-dsa starts with a shared sparse-attention layer"),
                       ({"pp": 2, "first_stage_layers": 2}, "--pipeline-model-parallel-size 2: the stage starting at "
                                                            "layer 2")):
        with pytest.raises(ConfigError) as e:
            transformer_config(mc, overrides={}, **pp_kw)
        assert str(e.value).startswith(msg) and "\n" not in str(e.value), str(e.value)
    # stages [0], [1, 2], with full recompute (the shared layer queues its top-k for the recompute, models/dsa.py)
    recompute = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    transformer_config(mc, pp=2, first_stage_layers=1, overrides=recompute)


def test_glm5_indexer_k_norm_is_transformers_layernorm_at_1e_6():
    """transformers builds GLM-5's indexer.k_norm as nn.LayerNorm(index_head_dim, eps=1e-6) whatever
    rms_norm_eps (GLM-5: 1e-5) says; megatron's DSAIndexer passes layernorm_epsilon."""
    from types import SimpleNamespace

    from rlslurm.models.dsa import IndexerKNorm, IndexerLinear

    norm = IndexerKNorm(SimpleNamespace(params_dtype=torch.float32), hidden_size=128, eps=1e-5)
    assert isinstance(norm, torch.nn.LayerNorm) and norm.eps == 1e-6 and norm.bias.shape == (128,)
    lin = IndexerLinear(16, 8, config=SimpleNamespace(params_dtype=torch.float32, perform_initialization=False),
                        init_method=None, bias=False, parallel_mode="duplicated")
    out, bias = lin(torch.ones(2, 16))
    assert out.shape == (2, 8) and bias is None
    assert not hasattr(lin.weight, "tensor_model_parallel") and not getattr(lin.weight, "sequence_parallel", False)


TE_PROBE = r"""
import json, sys
from rlslurm.errors import ConfigError
from rlslurm.settings.model_config import load_model_config
from rlslurm.models.build import layer_specs, transformer_config, uses_te
from megatron.core import parallel_state as ps
ps.get_pipeline_model_parallel_rank = lambda *a, **k: 0  # one pipeline stage without process groups
ps.get_pipeline_model_parallel_world_size = lambda *a, **k: 1
mc = load_model_config("tiny-qwen3")
tcfg = transformer_config(mc, overrides={})
block = layer_specs(mc, tcfg)
attn = block.layer_specs[0].submodules.self_attention.submodules
r = {"impl": tcfg.transformer_impl, "uses_te": uses_te(tcfg),
     "linear_qkv": attn.linear_qkv.__module__ + "." + attn.linear_qkv.__name__}
try:
    transformer_config(mc, overrides={}, transformer_impl="transformer_engine")
    r["te"] = None
except ConfigError as e:
    r["te"] = str(e)
from rlslurm.settings.transformer_impl import te_refusal
r["te_on_gpu"] = te_refusal("transformer_engine", device="cuda", import_it=True)  # what the trainer asks on a GPU
print("RESULT" + json.dumps(r))
"""


def test_transformer_engine_is_used_only_when_asked_for(tmp_path):
    """An installed transformer-engine (here an invented stand-in of version 2.13.0 that does not import,
    tests/settings/test_transformer_impl.py) no longer picks transformer-engine's layer spec: rlslurm took it
    whenever `find_spec("transformer_engine")` found one. The default --transformer-impl local builds megatron's
    local spec, and asking for transformer_engine where it does not import, or is outside megatron-core's range,
    is one line naming the flag."""
    import subprocess
    import sys

    from convert_helpers import REPO

    from tests.helpers.transformer_engine_stub import fake_transformer_engine

    fake = fake_transformer_engine(tmp_path / "te", "2.13.0")
    p = subprocess.run([sys.executable, "-c", TE_PROBE], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{fake}:{REPO}", "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-4000:]
    r = __import__("json").loads(p.stdout.split("RESULT", 1)[1])
    assert r["impl"] == "local" and not r["uses_te"]
    assert r["linear_qkv"] == "megatron.core.tensor_parallel.layers.ColumnParallelLinear", r
    if not __import__("torch").cuda.is_available():
        assert r["te"] == ("--transformer-impl transformer_engine with --device cpu: transformer-engine has no CPU "
                           "kernels; use --transformer-impl local")
    gpu = r["te_on_gpu"]
    assert gpu.startswith("--transformer-impl transformer_engine: transformer-engine 2.13.0 ") and "\n" not in gpu
    # megatron-core 0.16.1 declares transformer-engine <2.12.0; 0.19.2 declares no range, and the
    # stand-in does not import
    assert "is outside what megatron-core" in gpu or "does not import: ModuleNotFoundError: an invented" in gpu, gpu


_CORES = """
import json, sys
import torch.distributed as dist
from megatron.core import parallel_state as ps
from rlslurm.models.build import layer_specs, transformer_config
from rlslurm.models.specs import unique_specs
from rlslurm.settings.model_config import load_model_config
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % int(sys.argv[1]), rank=0, world_size=1)
ps.initialize_model_parallel(1)
out = {}
for model, over in (("tiny-qwen3", {}), ("tiny-deepseek-v3", {}), ("tiny-qwen3", {"attention_dropout": 0.1})):
    mc = load_model_config(model)
    block = layer_specs(mc, transformer_config(mc, overrides=over))
    cores = {s.submodules.self_attention.submodules.core_attention for s in unique_specs(block)}
    out[model + (" dropout" if over else "")] = sorted(getattr(c, "__name__", type(c).__name__) for c in cores)
print(json.dumps(out))
"""


def test_core_attention_is_torchs_fused_one_unless_attention_dropout_is_asked_for():
    """Without transformer-engine every layer's core attention is rlslurm's SDPACoreAttention (torch's fused
    attention, flash on a GPU; models/specs.py core_attention), for the MLA families too; megatron's local
    DotProductAttention only where --megatron-attention-dropout asks for what SDPACoreAttention does not do.
    (In a child process: megatron's layer specs need its parallel state.)"""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from rlslurm.net import free_port

    repo = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, "-c", _CORES, str(free_port())], capture_output=True, text=True,
                       timeout=300, cwd=repo)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["tiny-qwen3"] == ["SDPACoreAttention"] and got["tiny-deepseek-v3"] == ["SDPACoreAttention"], got
    assert got["tiny-qwen3 dropout"] == ["DotProductAttention"], got
