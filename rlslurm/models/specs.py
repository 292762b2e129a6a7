"""The changes rlslurm makes to megatron-core's stock decoder block spec (models/build.py layer_specs).

For every model: without transformer-engine, norms that take sequence parallelism and zero-centred
weights, MLA's down projections as TP-duplicated linears (`local_spec_fixes`), and a core attention
that takes packed sequences, context parallelism and MLA's head dims (`core_attention`,
`SDPACoreAttention`). For one family, called by its Family.layer_spec (rlslurm/models/families/):
GLM-4's sandwich norms (`post_norms`), MiniMax-M2's q/k norm over all heads (`all_heads_qk_norm`,
models/qk_norm.py), Qwen3-Next's gated delta net layers (`gated_delta_net_layers`,
models/gated_delta.py), GLM-5's sparse attention (`sparse_attention`, models/dsa.py).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from rlslurm.errors import ConfigError
from rlslurm.models.attention_ops import repeat_kv_heads, varlen_attn, varlen_causal
from rlslurm.settings.model_config import ModelConfig
from rlslurm.settings.transformer_impl import LOCAL, TE


def uses_te(tcfg) -> bool:
    """Whether `tcfg` asks for transformer-engine's layers (--transformer-impl, never TE's importability:
    rlslurm/settings/transformer_impl.py)."""
    return getattr(tcfg, "transformer_impl", LOCAL) == TE


def built_layers(model: torch.nn.Module) -> str:
    """The classes the first attention layer was built of, as `name=Class` pairs (the trainer's log: which
    --transformer-impl actually ran, e.g. linear_qkv=TELayerNormColumnParallelLinear under transformer-engine)."""
    for m in model.modules():
        attn = getattr(m, "self_attention", None)
        if isinstance(attn, torch.nn.Module):
            parts = [f"{n}={type(c).__name__}" for n, c in attn.named_children()
                     if n.startswith("linear_") or n == "core_attention"]
            return ", ".join(parts) or type(attn).__name__
    return "no attention layer"


class TorchNorm:
    """megatron's local norm (torch RMSNorm/LayerNorm) without its sequence-parallel refusal.

    Megatron's `WrappedTorchNorm` asserts `not sequence_parallel`, yet megatron refuses to *train*
    MoE with TP > 1 unless sequence parallelism is on (moe_layer.py:379). Under sequence
    parallelism a norm on sequence-sharded activations only needs its weight grads summed over
    TP, which megatron's finalize_model_grads does for params marked `sequence_parallel`. So:
    `TorchNorm` (q/k/kv norms, which see the gathered sequence) and `SPTorchNorm` (the residual
    stream norms, marked) make MoE + TP trainable without transformer-engine.
    """

    mark_sequence_parallel = False

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.Module:
        if config.normalization == "RMSNorm" and config.layernorm_zero_centered_gamma:
            from rlslurm.models.gated_delta import ZeroCenteredRMSNorm

            norm: torch.nn.Module = ZeroCenteredRMSNorm(hidden_size, eps=eps)
        elif config.layernorm_zero_centered_gamma:
            raise ConfigError("layernorm_zero_centered_gamma with LayerNorm: not built without transformer-engine")
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        else:
            raise ConfigError(f"normalization={config.normalization!r}: expected RMSNorm or LayerNorm")
        if cls.mark_sequence_parallel and config.sequence_parallel:
            for p in norm.parameters():
                setattr(p, "sequence_parallel", True)
        return norm


class SPTorchNorm(TorchNorm):
    mark_sequence_parallel = True


def _norm_module(config) -> torch.nn.Module:
    if uses_te(config):
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm(config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)
    return SPTorchNorm(config, config.hidden_size, eps=config.layernorm_epsilon)


def local_spec_fixes(block, tcfg) -> None:
    """Without TE: MLA's duplicated down projections; under sequence parallelism our torch norms."""
    from megatron.core.models.gpt.gpt_layer_specs import LNImpl

    if uses_te(tcfg):
        return
    for spec in {id(s.submodules): s for s in block.layer_specs}.values():  # layers share spec objects
        attn = getattr(spec.submodules.self_attention, "submodules", None)
        if getattr(attn, "linear_kv_down_proj", None) is not None:
            # MLA down projections as TP-duplicated linears (what the TE spec does), at every TP
            # so that checkpoints re-shard between TP sizes. As column-parallel linears (the local
            # spec), MLA gathers their outputs with gather_from_tensor_model_parallel_region, whose
            # backward only splits: the shared rope key k_pos_emb then gets each rank's partial
            # (own heads') gradient, and kv_down_proj/embedding grads are wrong at TP > 1 under
            # megatron-core 0.16. The duplicated path gathers k_pos_emb from the
            # sequence-parallel region, whose backward reduce-scatters, and marks the weights
            # `sequence_parallel` for the TP grad sum.
            from megatron.core.post_training.modelopt.layers import Linear

            for field in ("linear_q_down_proj", "linear_kv_down_proj"):
                setattr(attn, field, Linear)
            if tcfg.q_lora_rank is None and hasattr(spec.submodules.self_attention.module, "_resolve_qk_norm_config"):
                spec.submodules.self_attention = dataclasses.replace(
                    spec.submodules.self_attention,
                    module=_mla_without_query_latent(spec.submodules.self_attention.module))
    # Qwen3-Next's zero-centred norms: megatron's local norm refuses them, TorchNorm builds them
    if not tcfg.sequence_parallel and not tcfg.layernorm_zero_centered_gamma:
        return
    if block.layer_norm is LNImpl:
        block.layer_norm = SPTorchNorm
    for spec in block.layer_specs:
        sub = spec.submodules
        for field in ("input_layernorm", "pre_mlp_layernorm"):
            if getattr(sub, field, None) is LNImpl:
                setattr(sub, field, SPTorchNorm)
        attn = getattr(sub.self_attention, "submodules", None)
        for field in ("q_layernorm", "k_layernorm"):
            if getattr(attn, field, None) is LNImpl:
                setattr(attn, field, TorchNorm)  # finalize_model_grads sums these over TP by name
        if getattr(attn, "kv_layernorm", None) is LNImpl:
            # MLA: the kv norm feeds the head-split kv_up_proj, so each TP rank holds a partial
            # gradient, but finalize_model_grads' name rule ("q_layernorm"/"k_layernorm") misses
            # "kv_layernorm" (megatron-core 0.16). Marked, it is summed like the other SP norms.
            setattr(attn, "kv_layernorm", SPTorchNorm)


def _mla_without_query_latent(base: type) -> type:
    class MLAWithoutQueryLatent(base):  # type: ignore[misc,valid-type]
        """Moonlight (DeepSeek-V2-Lite): MLA without a query latent (q_lora_rank None) but with the kv
        latent's norm. megatron-core 0.19's norm resolver (transformer/mla_qk_norm_config.py) then asks for
        a fused norm+linear query projection, which the local backend does not have, and refuses a
        standalone query norm; HF applies none to the query (the layer's input norm comes first). The
        modules are 0.16's: a plain linear_q_proj, no query norm, the kv norm of the spec
        (docs/megatron-versions.md, "Layer specs")."""

        def _resolve_qk_norm_config(self, submodules):
            from megatron.core.transformer.identity_op import IdentityOp

            return dict(linear_q_proj=submodules.linear_q_proj, linear_q_up_proj=IdentityOp,
                        linear_kv_up_proj=submodules.linear_kv_up_proj, q_layernorm=IdentityOp,
                        kv_layernorm=submodules.kv_layernorm)

    return MLAWithoutQueryLatent


def _self_attention_with_post_norm(base: type) -> type:
    class SelfAttentionWithPostNorm(base):  # type: ignore[misc,valid-type]
        """GLM-4: a norm on the attention output before the residual add.

        The output of `linear_proj` (row-parallel, reduced over TP) is the full hidden state on
        every TP rank, so the norm is replicated like every other norm.
        """

        def __init__(self, config, *args: Any, **kwargs: Any):
            super().__init__(config, *args, **kwargs)
            self.post_self_attn_layernorm = _norm_module(config)

        def forward(self, *args: Any, **kwargs: Any):
            out, bias = super().forward(*args, **kwargs)
            if bias is not None:
                out, bias = out + bias, None  # norm applies to the biased output
            return self.post_self_attn_layernorm(out), bias

    return SelfAttentionWithPostNorm


def _self_attention_with_all_heads_qk_norm(base: type, q_heads: int, k_heads: int) -> type:
    class SelfAttentionWithAllHeadsQKNorm(base):  # type: ignore[misc,valid-type]
        """MiniMax-M2: rlslurm's all-heads q/k norms (models/qk_norm.py) as `q_layernorm`/`k_layernorm`,
        which SelfAttention applies when set. Built here rather than named in the spec: the config keeps
        megatron's `qk_layernorm` off for them, and megatron-core 0.19 refuses q/k norm submodules while
        it is off (docs/megatron-versions.md, "Layer specs")."""

        def __init__(self, config, *args: Any, **kwargs: Any):
            from rlslurm.models.qk_norm import AllHeadsRMSNorm

            super().__init__(config, *args, **kwargs)
            head_dim = self.hidden_size_per_attention_head
            self.q_layernorm = AllHeadsRMSNorm(config, head_dim, eps=config.layernorm_epsilon, heads=q_heads)
            self.k_layernorm = AllHeadsRMSNorm(config, head_dim, eps=config.layernorm_epsilon, heads=k_heads)

    return SelfAttentionWithAllHeadsQKNorm


def _mlp_with_post_norm(base: type) -> type:
    class MLPWithPostNorm(base):  # type: ignore[misc,valid-type]
        """GLM-4: a norm on the MLP output before the residual add (see SelfAttentionWithPostNorm)."""

        def __init__(self, config, *args: Any, **kwargs: Any):
            super().__init__(config, *args, **kwargs)
            self.post_mlp_layernorm = _norm_module(config)

        def forward(self, *args: Any, **kwargs: Any):
            out, bias = super().forward(*args, **kwargs)
            if bias is not None:
                out, bias = out + bias, None
            return self.post_mlp_layernorm(out), bias

        def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
            # MLP.sharded_state_dict asks every child for its own sharded_state_dict, which a plain
            # torch norm lacks: take the norm out, then add it as a replicated tensor.
            from megatron.core.transformer.utils import sharded_state_dict_default

            norm = self._modules.pop("post_mlp_layernorm")
            try:
                sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
            finally:
                self._modules["post_mlp_layernorm"] = norm
            kw: dict[str, Any] = {}
            if "tp_group" in inspect.signature(sharded_state_dict_default).parameters:
                # Without it every TP rank claims to be the main replica of the norm.
                from megatron.core import parallel_state as ps

                kw["tp_group"] = getattr(self, "tp_group", None) or ps.get_tensor_model_parallel_group()
            sd.update(sharded_state_dict_default(norm, f"{prefix}post_mlp_layernorm.", sharded_offsets,
                                                 metadata, **kw))
            return sd

    return MLPWithPostNorm


class SDPACoreAttention(torch.nn.Module):
    """Causal core attention by torch's scaled_dot_product_attention, without transformer-engine.

    Every layer's without transformer-engine (`core_attention` below says why). Packed, q/k/v
    come as [t, heads, dim] over the concatenated sequences of a micro-batch, and each sequence
    attends causally within itself (`cu_seqlens`): on CUDA one flash varlen call, elsewhere one SDPA
    call per sequence; no [t, t] mask is built (docs/sequence-packing.md).
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 softmax_scale: float | None = None, **_: Any):
        super().__init__()
        self.config = config
        self.softmax_scale = softmax_scale
        self.attn_mask_type = attn_mask_type

    def _sdpa(self, q, k, v):
        """[b, h, s, d] causal attention; grouped query heads repeated as megatron's local path does."""
        k, v = repeat_kv_heads(q, k, v)
        # On CUDA the flash / memory-efficient kernels accumulate the softmax in fp32 themselves and
        # take no fp32 inputs (an fp32 upcast falls back to the slower math kernel:
        # bench/results/packing-h200.md); elsewhere upcast as megatron does.
        if self.config.attention_softmax_in_fp32 and q.dtype != torch.float32 and not q.is_cuda:
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True,
                                                  scale=self.softmax_scale).to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **_: Any):
        if self.config.context_parallel_size > 1:
            return self._context_parallel(query, key, value, packed_seq_params)
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd":
                raise NotImplementedError(f"SDPACoreAttention: qkv_format {packed_seq_params.qkv_format!r}")
            # flash varlen takes fp16/bf16 only ("FlashAttention only support fp16 and bf16",
            # docs/sequence-packing.md); fp32 keeps the per-sequence loop below
            if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and varlen_attn() is not None:
                return varlen_causal(query, key, value, packed_seq_params, self.softmax_scale)
            # [t, h, d] -> per sequence [1, h, s, d] -> [t, h * dv]
            bounds = packed_seq_params.cu_seqlens_q.tolist()
            outs = []
            for a, b in zip(bounds[:-1], bounds[1:]):
                q, k, v = (t[a:b].permute(1, 0, 2).unsqueeze(0) for t in (query, key, value))
                outs.append(self._sdpa(q, k, v)[0].permute(1, 0, 2).reshape(b - a, -1))
            return torch.cat(outs, dim=0)
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = self._sdpa(q, k, v)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


    def _context_parallel(self, query, key, value, packed_seq_params):
        """CP > 1: this rank's queries against every CP rank's keys (models/context_parallel.py)."""
        from rlslurm.models import context_parallel as cpx

        fp32 = bool(self.config.attention_softmax_in_fp32)
        if packed_seq_params is None:
            return cpx.attend_padded(query, key, value, scale=self.softmax_scale, fp32=fp32, group=cpx.cp_group())
        if packed_seq_params.qkv_format != "thd":
            raise NotImplementedError(f"SDPACoreAttention: qkv_format {packed_seq_params.qkv_format!r}")
        use_varlen = query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and varlen_attn() is not None
        return cpx.attend_packed(query, key, value, packed_seq_params.cu_seqlens_q, scale=self.softmax_scale,
                                 fp32=fp32, group=cpx.cp_group(), varlen=varlen_attn() if use_varlen else None)


def _extend_mlp_spec(mc: ModelConfig, mlp_spec):
    """The dense MLP spec with GLM-4's post-MLP norm, for both spec styles megatron has used."""
    if isinstance(mlp_spec, functools.partial):
        # megatron-core 0.19: `partial(MLP.as_mlp_submodule, submodules=...)`, a classmethod that
        # builds `cls(...)`: rebind it to the subclass.
        owner = getattr(mlp_spec.func, "__self__", None)
        if not isinstance(owner, type):
            raise ConfigError(f"model config {mc.name}: cannot extend MLP spec {mlp_spec!r} with post_mlp_layernorm")
        return functools.partial(getattr(_mlp_with_post_norm(owner), mlp_spec.func.__name__),
                                 *mlp_spec.args, **mlp_spec.keywords)
    params = dict(mlp_spec.params or {})
    # 0.16: TransformerLayer hands tp_group only to classes it knows; pass it through the spec.
    if "tp_group" in inspect.signature(mlp_spec.module.__init__).parameters and "tp_group" not in params:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            params["tp_group"] = ps.get_tensor_model_parallel_group()
    return dataclasses.replace(mlp_spec, module=_mlp_with_post_norm(mlp_spec.module), params=params)


def gated_delta_net_layers(mc: ModelConfig, block, tcfg, *, vp_stage: int | None) -> None:
    """Qwen3-Next: the linear-attention layers of this stage get megatron-core's GatedDeltaNet as their
    `self_attention` (the rest of each layer, norms and MLP/MoE, is the stock spec's).

    megatron's own hybrid spec (`experimental_attention_variant_module_specs`) would place it, but
    accepts transformer-engine only, and GatedDeltaNet refuses to build without fla: rlslurm installs
    its own kernels into that module (models/gated_delta.py `install`) and builds this spec itself,
    as megatron's `get_gated_delta_net_module_spec` does: in_proj column-parallel (with TE the
    input norm fused into it, as megatron's spec does), the output norm rlslurm's GatedOutputNorm
    (HF's plain-weight gated norm, not the zero-centred norm of the rest), out_proj row-parallel.
    docs/model-families.md, "Qwen3-Next"."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from rlslurm.models import gated_delta

    gated_delta.install()
    if uses_te(tcfg):
        from megatron.core.extensions.transformer_engine import TELayerNormColumnParallelLinear, TERowParallelLinear

        in_proj, out_proj = TELayerNormColumnParallelLinear, TERowParallelLinear
    else:
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

        in_proj, out_proj = ColumnParallelLinear, RowParallelLinear
    # megatron's GatedDeltaNet, with rlslurm's context parallelism (its forward at CP 1)
    gdn = ModuleSpec(module=gated_delta.context_parallel_gated_delta_net(), submodules=GatedDeltaNetSubmodules(
        in_proj=in_proj, out_norm=gated_delta.GatedOutputNorm, out_proj=out_proj))
    interval = mc.arch.gated_delta_net.full_attention_interval
    from megatron.core import parallel_state as ps

    # this stage's first layer (no process groups, as in unit tests: the whole model on one stage)
    offset = get_transformer_layer_offset(tcfg, vp_stage=vp_stage) if ps.model_parallel_is_initialized() else 0
    specs = []
    for i, spec in enumerate(block.layer_specs):
        if (offset + i + 1) % interval:  # linear attention (HF layer_types "linear_attention")
            spec = dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=gdn))
        specs.append(spec)
    block.layer_specs = specs


def _share_top_k(mc: ModelConfig, tcfg, block, holder: dict, vp_stage: int | None) -> None:
    """GLM-5.2: the shared layers of this stage get a core attention of their own (no indexer: the
    top-k of the last indexer layer before them, models/dsa.py SharedTopKAttention)."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from rlslurm.models.dsa import shared_attention_spec, source_layer

    offset = get_transformer_layer_offset(tcfg, vp_stage=vp_stage)
    shared = set(mc.arch.dsa.shared_layers)
    for i, spec in enumerate(block.layer_specs):
        if offset + i not in shared:
            continue
        if i == 0:
            raise ConfigError(f"model config {mc.name}: the pipeline stage starting at layer {offset} starts with a "
                              "shared sparse-attention layer, whose top-k comes from a layer of an earlier stage")
        spec = copy.deepcopy(spec)
        spec.submodules.self_attention.submodules.core_attention = shared_attention_spec(
            holder, source_layer(mc, offset + i) + 1)
        block.layer_specs[i] = spec


def unique_specs(block) -> Iterator[Any]:
    """The block's layer specs, each object once (several layers share one spec object)."""
    seen: set[int] = set()
    for spec in block.layer_specs:
        if id(spec) not in seen:
            seen.add(id(spec))
            yield spec


def core_attention(mc: ModelConfig, block, tcfg, *, packed: bool) -> None:
    """Without transformer-engine, every layer's core attention is SDPACoreAttention: torch's fused
    scaled_dot_product_attention (flash on a GPU) instead of megatron's local DotProductAttention, which
    builds each head's [s, s] scores and softmaxes them unfused (`masked_softmax_fusion` is off:
    models/build.py). On one H100, megatron's own step on 16 x 2048 padded tokens ran at 25.2 % MFU with it
    and 17.0 % with the local one (bench/results/gpu-lease-2026-12-07d.md section 4, -07c.md section 4).
    Both are causal without a padding mask (the trainer passes none: trainer/logprobs.py), which is exact
    for rlslurm's right-padded batches: no real token attends to a pad. SDPACoreAttention also takes what the
    local one cannot: packed input, context parallelism (docs/context-parallel.md), MLA's query/key head
    dim that differs from the value's. The local one stays only where a user asks for attention dropout
    (--megatron-attention-dropout), which SDPACoreAttention does not apply, and it can run."""
    for spec in unique_specs(block):
        sub = spec.submodules
        if tcfg.attention_dropout and not packed and tcfg.context_parallel_size == 1:
            core = sub.self_attention.submodules.core_attention
            if not mc.arch.mla or "k_channels" in inspect.signature(getattr(core, "module", core).__init__).parameters:
                continue
        sub.self_attention.submodules.core_attention = SDPACoreAttention


def post_norms(mc: ModelConfig, block) -> None:
    """GLM-4's sandwich norms: after the attention and after the MLP, before each residual add."""
    a = mc.arch
    for spec in unique_specs(block):
        sub = spec.submodules
        if a.post_self_attn_layernorm:
            sub.self_attention = dataclasses.replace(
                sub.self_attention, module=_self_attention_with_post_norm(sub.self_attention.module))
        if a.post_mlp_layernorm:
            if a.moe:
                raise ConfigError(f"model config {mc.name}: post_mlp_layernorm with MoE is not supported")
            sub.mlp = _extend_mlp_spec(mc, sub.mlp)


def all_heads_qk_norm(mc: ModelConfig, block) -> None:
    """MiniMax-M2's q/k norm over all heads (models/qk_norm.py) in every layer's self attention."""
    a = mc.arch
    if not a.qk_layernorm_all_heads:
        return
    for spec in unique_specs(block):
        sub = spec.submodules
        sub.self_attention = dataclasses.replace(sub.self_attention, module=_self_attention_with_all_heads_qk_norm(
            sub.self_attention.module, a.num_attention_heads, a.num_query_groups))


def sparse_attention(mc: ModelConfig, block, tcfg, *, vp_stage: int | None, packed: bool) -> None:
    """GLM-5: megatron-core's DSA core attention with rlslurm's indexer in every layer (models/dsa.py);
    GLM-5.2's shared layers reuse the top-k of the indexer layer before them (`_share_top_k`)."""
    if mc.arch.dsa is None:
        return
    if packed:
        from rlslurm.settings.sparse_attention import sparse_attention_refusal

        raise ConfigError(sparse_attention_refusal(mc, qkv_format="thd"))
    from megatron.core.transformer.identity_op import IdentityOp

    from rlslurm.models.dsa import core_attention_spec

    holder: dict = {}  # GLM-5.2: each indexer layer's top-k, for the shared layers after it (models/dsa.py)
    for spec in unique_specs(block):
        sub = spec.submodules
        if getattr(sub.self_attention.submodules, "q_layernorm", None) in (None, IdentityOp):
            # transformer-engine's MLA spec fuses the query-latent norm into linear_q_up_proj; MLA
            # would then hand the indexer the un-normalised latent, transformers the normalised one
            raise ConfigError(f"model config {mc.name}: its sparse attention needs MLA's query-latent norm as "
                              "a module of its own (megatron's local spec), not fused into linear_q_up_proj "
                              "(transformer-engine's): the indexer reads the normalised latent")
        sub.self_attention.submodules.core_attention = core_attention_spec(holder)
    if mc.arch.dsa.shared_layers:
        _share_top_k(mc, tcfg, block, holder, vp_stage)
