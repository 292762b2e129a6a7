"""GLM-5's DeepSeek sparse attention (DSA) on megatron-core's DSA modules (0.16 and 0.19: docs/megatron-versions.md).

megatron-core 0.16 has DSA in `transformer/experimental_attention_variant/dsa.py` (`DSAttention`, the
MLA core attention that masks every query to the top-k keys its `DSAIndexer` picks) and a spec for it
(`models/gpt/experimental_attention_variant_module_specs.py` `get_dsa_module_spec_for_backend`,
transformer-engine only). transformers 5.19's GLM-5 (`models/glm_moe_dsa/modeling_glm_moe_dsa.py`
`GlmMoeDsaIndexer`, `GlmMoeDsaAttention`) computes the same top-k attention, with four differences that
the classes here take care of (docs/model-families.md, "GLM-5"):

- rotary part first: GLM-5's indexer rotates the *leading* `qk_rope_head_dim` dims of its q and k
  (`torch.split(q, [rope, rest])`), megatron's `DSAIndexer._apply_rope` the trailing ones. The scores
  are dot products, so this only permutes dims, but the checkpoint's weights are laid out for the
  leading part: `GLM5Indexer._apply_rope` rotates the leading part (megatron's own
  `apply_rotary_pos_emb` does exactly that when handed the whole head: `rope_utils.py`
  `_apply_rotary_pos_emb_bshd` rotates `t[..., :rot_dim]` and passes the rest), and the HF tensors
  map name for name, unpermuted (slime permutes them instead: its megatron_to_hf/deepseekv3.py).
- Hadamard: megatron rotates q and k with `fast_hadamard_transform` (a CUDA extension, absent here and
  on the GPU machines) and asserts bf16; `GLM5Indexer` uses rlslurm's torch transform
  (models/hadamard.py) in any dtype. transformers applies none: orthonormal, it changes the scores
  by rounding only.
- k norm epsilon: transformers builds `indexer.k_norm` as `nn.LayerNorm(index_head_dim, eps=1e-6)`,
  megatron with `layernorm_epsilon` (GLM-5: 1e-5): `IndexerKNorm` is a torch LayerNorm at 1e-6.
- the indexer's linears: megatron builds them with `parallel_mode="duplicated"`, which only
  transformer-engine's linear takes; `IndexerLinear` is a plain linear, replicated on every TP rank.

Context parallelism: megatron-core 0.16 asserts CP 1 for DSA (`TransformerConfig`). `GLM5DSAttention`
does it in rlslurm's CP layout (models/context_parallel.py: two load-balanced chunks of every row per
rank): the indexer keys and MLA's keys/values of every CP rank are all-gathered, and this rank's
queries, at their own positions of the row, pick and attend to their top-k among all keys
(`sparse_attention`, megatron's `unfused_dsa_fn` with that causal mask). models/build.py builds the
TransformerConfig without the DSA switch at CP > 1 and sets it afterwards.

The indexer is not trained. transformers runs it under `torch.no_grad()`, megatron's `DSAttention`
detaches its inputs, so the LM loss gives its weights no gradient; megatron trains it only by its
KL loss against the attention scores (`compute_dsa_indexer_loss`, `dsa_indexer_loss_coeff`), which
slime's run-glm5 scripts do not set. `freeze_indexer` turns `requires_grad` off (the optimizer then
leaves the weights exactly as loaded: no weight decay), and `GLM5DSAttention` skips the loss, whose
dense fp32 [b, heads, s, s] scores would cost as much as dense attention.
`--megatron-dsa-indexer-loss-coeff` > 0 is refused (rlslurm/settings/sparse_attention.py).

GLM-5.2's "shared" layers (no indexer; the top-k of the last indexer layer before them):
`SharedTopKAttention`, fed by the full layers' `GLM5DSAttention` through a dict per model build.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from rlslurm.models.hadamard import rotate_activation

# transformers' GlmMoeDsaIndexer: `nn.LayerNorm(self.head_dim, eps=1e-6)`, whatever rms_norm_eps says
HF_INDEXER_K_NORM_EPS = 1e-6


class IndexerLinear(torch.nn.Linear):
    """A linear replicated on every TP rank (megatron's `parallel_mode="duplicated"`), returning
    (output, bias) as megatron's linears do. Not marked `sequence_parallel`: the indexer runs on the
    gathered sequence, so each TP rank computes the whole of it (and it is frozen, freeze_indexer)."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method=None, bias: bool = False,
                 skip_bias_add: bool = False, parallel_mode: str | None = "duplicated", **_: Any):
        if parallel_mode not in (None, "duplicated"):
            raise ValueError(f"IndexerLinear: parallel_mode={parallel_mode!r} (only duplicated)")
        super().__init__(input_size, output_size, bias=bias, dtype=config.params_dtype)
        self._return_bias = skip_bias_add and bias
        if init_method is not None and config.perform_initialization:
            with torch.no_grad():
                init_method(self.weight)
        for p in self.parameters():
            setattr(p, "allreduce", True)

    def forward(self, x: torch.Tensor):
        if self._return_bias:
            return torch.nn.functional.linear(x, self.weight), self.bias
        return super().forward(x), None


class IndexerKNorm(torch.nn.LayerNorm):
    """transformers' `indexer.k_norm`: LayerNorm with weight and bias at eps 1e-6 (megatron would pass
    its layernorm_epsilon)."""

    def __init__(self, config, hidden_size: int, eps: float = HF_INDEXER_K_NORM_EPS, **_: Any):
        super().__init__(hidden_size, eps=HF_INDEXER_K_NORM_EPS, dtype=config.params_dtype)


def _mla_rope_layout(apply_rotary_pos_emb) -> dict[str, Any]:
    """How to ask megatron's `apply_rotary_pos_emb` for MLA's rope layout: 0.16 takes it from
    `config.multi_latent_attention` (on for GLM-5), 0.19 from its `mla_rotary_interleaved` argument, off by
    default (docs/megatron-versions.md, "GLM-5's sparse attention (DSA)")."""
    if "mla_rotary_interleaved" in inspect.signature(apply_rotary_pos_emb).parameters:
        return {"mla_rotary_interleaved": True}
    return {}


@functools.cache
def _indexer_class():
    from megatron.core.models.common.embeddings import apply_rotary_pos_emb
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexer

    class GLM5Indexer(DSAIndexer):
        """megatron's DSAIndexer with GLM-5's rotary layout and rlslurm's Hadamard transform."""

        mla_layout = _mla_rope_layout(apply_rotary_pos_emb)

        def _apply_rope(self, x: torch.Tensor, rotary_pos_emb: torch.Tensor, mscale: float) -> torch.Tensor:
            # the whole head: megatron rotates its leading rot_dim dims and passes the rest, in MLA's
            # layout (even dims, then odd ones, then rotate-half), as transformers' GLM-5 does
            return apply_rotary_pos_emb(x, rotary_pos_emb, config=self.config, cu_seqlens=None, mscale=mscale,
                                        cp_group=self.pg_collection.cp, **self.mla_layout)

        def forward_with_scores(self, x, qr, mask=None, packed_seq_params=None):
            """megatron's DSAIndexer.forward_with_scores (same steps, same shapes) with the two
            changes above, and under context parallelism this rank's queries against every CP rank's
            keys (`mask` then [local queries, all keys]); returns (index_scores [b, sq, sk] fp32,
            topk_indices [b, sq, k], indices into the whole sequence)."""
            if packed_seq_params is not None:
                raise NotImplementedError("GLM-5 sparse attention takes no packed sequences (--qkv-format thd)")
            seq_len = self.rotary_pos_emb.get_rotary_seq_len(None, None, x, self.config, None)
            if self.config.rope_type == "rope":
                rotary_pos_emb, mscale = self.rotary_pos_emb(seq_len, packed_seq=False), 1.0
            else:
                rotary_pos_emb, mscale = self.rotary_pos_emb(seq_len, packed_seq=False)
            if self.config.sequence_parallel and self.pg_collection.tp.size() > 1:
                x = gather_from_sequence_parallel_region(x, group=self.pg_collection.tp)
                qr = gather_from_sequence_parallel_region(qr, group=self.pg_collection.tp)
            s, b, _ = x.size()
            q, _ = self.linear_wq_b(qr)
            q = self._apply_rope(q.reshape(s, b, self.index_n_heads, self.index_head_dim), rotary_pos_emb, mscale)
            k, _ = self.linear_wk(x)
            k = self._apply_rope(self.k_norm(k).reshape(s, b, 1, self.index_head_dim), rotary_pos_emb, mscale)
            q, k = rotate_activation(q), rotate_activation(k.reshape(s, b, self.index_head_dim))
            if self.config.context_parallel_size > 1:
                k = _cp_full_keys(k)  # no gradient: the indexer is frozen and its inputs detached
            weights, _ = self.linear_weights_proj(x)
            # relu(q.k) * scale == relu(q.k * scale): transformers scales inside the relu
            weights = weights * (self.index_n_heads ** -0.5) * self.softmax_scale
            # megatron's _compute_index_scores, here so that no private method of another megatron version
            # is needed: relu(q . k) per head, weighted, summed over the heads -> [b, sq, sk] fp32
            scores = torch.einsum("sbhd,tbd->sbht", q.float(), k.float()).relu_()
            scores = (scores * weights.float().unsqueeze(-1)).sum(dim=2).transpose(0, 1)
            if mask is not None:
                scores = scores + mask
            return scores, scores.topk(min(self.index_topk, k.size(0)), dim=-1)[1]

    return GLM5Indexer


@functools.cache
def _attention_class():
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAttention

    class GLM5DSAttention(DSAttention):
        """megatron's DSAttention; the indexer's KL loss only when dsa_indexer_loss_coeff > 0 (never,
        in rlslurm: refused), so no dense score matrix is built for nothing; CP in rlslurm's layout;
        its top-k left in `holder` (by layer number) for GLM-5.2's shared layers after it."""

        def __init__(self, *args: Any, holder: dict | None = None, **kw: Any):
            super().__init__(*args, **kw)
            self.holder = holder

        def forward(self, query, key, value, attention_mask, x=None, qr=None, **kw: Any):
            if x is None or qr is None:
                raise RuntimeError("GLM-5 sparse attention needs MLA's hidden states and query latent; selective "
                                   "recompute of core_attn does not pass them")
            _check_kw(kw)
            if self.config.context_parallel_size == 1 and (self.config.dsa_indexer_loss_coeff or 0.0) > 0:
                return super().forward(query, key, value, attention_mask, x=x, qr=qr, **kw)
            key, value, causal = _keys_and_mask(self.config, query, key, value)
            _, topk = self.indexer.forward_with_scores(x.detach(), qr.detach(), mask=causal)
            if self.holder is not None:
                self.holder[self.layer_number] = topk
            return sparse_attention(query, key, value, topk, causal, self.softmax_scale)

    return GLM5DSAttention


def _check_kw(kw: dict) -> None:
    if kw.get("attn_mask_type") is None:
        raise NotImplementedError("GLM-5 sparse attention: only megatron's causal mask type is supported")
    if kw.get("packed_seq_params") is not None:
        raise NotImplementedError("GLM-5 sparse attention takes no packed sequences (--qkv-format thd)")


def _keys_and_mask(config, query, key, value):
    """(keys, values, causal mask [sq, skv] fp32) for this rank's queries: at CP > 1 the keys and values of
    every CP rank, all-gathered differentiably, and the queries at their own positions of the row
    (rlslurm's CP layout, models/context_parallel.py: two load-balanced chunks of every row per rank)."""
    sq, cp = query.size(0), config.context_parallel_size
    if cp > 1:
        from rlslurm.models import context_parallel as cpx

        full = sq * cp
        qpos = torch.tensor(cpx.columns([0, full], cp, cpx.cp_rank()), device=query.device)
        key, value = cpx._full_kv(key, value, [0, full], cpx.cp_group())
    else:
        qpos = torch.arange(sq, device=query.device)
    kpos = torch.arange(key.size(0), device=query.device)
    causal = torch.zeros(sq, key.size(0), dtype=torch.float32, device=query.device).masked_fill(
        kpos[None, :] > qpos[:, None], float("-inf"))
    return key, value, causal


class SharedTopKAttention(torch.nn.Module):
    """GLM-5.2's "shared" layer (transformers' GlmMoeDsaAttention with `skip_topk`): no indexer; MLA
    attends to the keys the last indexer layer before it kept (`source`, 1-based as megatron's
    layer_number), read from `holder`, which that layer's GLM5DSAttention filled in this forward (the
    source runs in the same pipeline stage: models/build.py refuses a stage that starts with a shared
    layer).

    Full activation recompute: megatron runs a checkpointed layer's forward under no_grad (in training
    mode) and again with grad in the backward, by which time other micro-batches' forwards have replaced
    the holder's entry (1F1B at PP > 1). So a no_grad training forward also queues the top-k it used,
    and a later grad forward of the same layer with a queue takes the oldest (micro-batches reach their
    backward in the order of their forwards, as megatron's schedules run them); a layer that is not
    checkpointed never queues. Eval forwards (rlslurm's log-probs: model.eval()) read the holder only."""

    def __init__(self, config, layer_number: int, softmax_scale: float | None = None, k_channels: int | None = None,
                 *, holder: dict, source: int, **_: Any):
        super().__init__()
        import collections
        import math

        self.config, self.layer_number, self.holder, self.source = config, layer_number, holder, source
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(
            k_channels if k_channels is not None else config.kv_channels)
        self.pending: collections.deque = collections.deque()  # top-k of checkpointed forwards, oldest first

    def _top_k(self, query):
        if self.training and torch.is_grad_enabled() and self.pending:
            topk = self.pending.popleft()  # the recompute of a checkpointed forward
        else:
            topk = self.holder.get(self.source)
            if self.training and not torch.is_grad_enabled() and topk is not None:
                self.pending.append(topk)  # a checkpointed forward: its recompute comes in the backward
        if topk is None or topk.shape[:2] != (query.size(1), query.size(0)):
            raise RuntimeError(f"GLM-5.2 shared layer {self.layer_number}: no top-k of layer {self.source} for this "
                               "micro-batch (its source must run before it, in the same pipeline stage)")
        return topk

    def forward(self, query, key, value, attention_mask, x=None, qr=None, **kw: Any):
        _check_kw(kw)
        topk = self._top_k(query)
        key, value, causal = _keys_and_mask(self.config, query, key, value)
        return sparse_attention(query, key, value, topk, causal, self.softmax_scale)


def _cp_full_keys(k: torch.Tensor) -> torch.Tensor:
    """The indexer keys [s_local, b, d] of every CP rank, in sequence order [s_local * cp, b, d]."""
    from rlslurm.models import context_parallel as cpx

    cp = cpx.cp_size()
    inv = cpx._inverse((0, k.size(0) * cp), cp).to(k.device)
    return cpx._all_gather(k.contiguous(), cpx.cp_group(), 0).index_select(0, inv)


def sparse_attention(query, key, value, topk, causal, softmax_scale: float):
    """megatron's `unfused_dsa_fn` with the causal mask given ([sq, skv]: a CP rank's queries sit at
    their own positions of the row, not its first sq): fp32 scores, -inf outside the top-k and the
    causal part, fp32 softmax, then the values in their dtype. [sq, b, np, hn] -> [sq, b, np * hnv]."""
    sq, b, np_, hn = query.size()
    skv, hnv = key.size(0), value.size(3)
    q = query.permute(1, 2, 0, 3).reshape(b * np_, sq, hn)
    k = key.permute(1, 2, 3, 0).reshape(b * np_, hn, skv)
    scores = (torch.bmm(q.float(), k.float()) * softmax_scale).reshape(b, np_, sq, skv)
    mask = torch.full((b, sq, skv), float("-inf"), device=scores.device).scatter_(-1, topk, 0)
    scores = scores + (mask + causal.view(1, sq, skv)).unsqueeze(1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).reshape(b * np_, sq, skv)
    v = value.permute(1, 2, 0, 3).reshape(b * np_, skv, hnv)
    out = torch.bmm(probs.to(value.dtype), v)
    return out.reshape(b, np_, sq, hnv).permute(2, 0, 1, 3).contiguous().reshape(sq, b, np_ * hnv)


def core_attention_spec(holder: dict | None = None):
    """The MLA core attention spec of a GLM-5 layer with an indexer: DSAttention with GLM-5's indexer,
    its top-k left in `holder` for the shared layers after it."""
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerSubmodules, DSAttentionSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    indexer = ModuleSpec(module=_indexer_class(), submodules=DSAIndexerSubmodules(
        linear_wq_b=IndexerLinear, linear_wk=IndexerLinear, k_norm=IndexerKNorm, linear_weights_proj=IndexerLinear))
    return ModuleSpec(module=_attention_class(), submodules=DSAttentionSubmodules(indexer=indexer),
                      params={"holder": holder})


def shared_attention_spec(holder: dict, source: int):
    """The core attention spec of a GLM-5.2 shared layer: layer `source`'s top-k (1-based)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(module=SharedTopKAttention, params={"holder": holder, "source": source})


def source_layer(mc, layer: int) -> int:
    """The 0-based layer whose top-k shared layer `layer` reuses: the last one before it with an indexer."""
    shared = set(mc.arch.dsa.shared_layers)
    return max(i for i in range(layer) if i not in shared)


def freeze_indexer(model: torch.nn.Module) -> int:
    """requires_grad off for every indexer parameter (see the module docstring); returns how many."""
    n = 0
    for name, p in model.named_parameters():
        if ".core_attention.indexer." in name:
            p.requires_grad_(False)
            n += 1
    return n
