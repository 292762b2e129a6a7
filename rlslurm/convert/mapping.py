"""The one HF <-> Megatron mapping: each family's rules (rlslurm/models/families/), applied; the re-layouts.

Three users share it: the trainer's HF load (`hf_to_mcore`, sharded for this rank), the weight
sync's export (`rlslurm.convert.export.mcore_to_hf`, gathered to full HF tensors), and the
checkpoint converter (`rlslurm convert`).

A `Rule` ties one Megatron tensor (named as in megatron's *local* layer spec, with `{E}` for an
expert index) to the HF tensor(s) it is made of, and says how they are laid out:

- `plain`: same tensor. Whether and along which dim it is split over TP is read from the
  Megatron parameter itself (`tensor_model_parallel`, `partition_dim`), so a layer that is
  duplicated under transformer-engine and column-parallel under the local spec (MLA's down
  projections) needs no second table.
- `vocab`: embedding / output layer: padded with zero rows to the TP-padded vocabulary on import,
  trimmed on export; split over TP along dim 0.
- `qkv`: HF q/k/v (weights or biases) fused into Megatron's `linear_qkv`, grouped by query group
  (`[q heads of group g, k_g, v_g]` for every g); the TP split is contiguous over groups.
- `gate_up`: HF gate and up (two tensors, or GLM-4's one fused `gate_up_proj`) concatenated into
  `linear_fc1`; for TP every rank holds `[gate_r; up_r]`, not a contiguous chunk.
- `gdn_in`: Qwen3-Next's gated delta net input projection: HF `in_proj_qkvz` and `in_proj_ba`, both
  grouped by key head, re-laid out as megatron's `in_proj` `[q; k; v; z; b; a]`, each part over all
  heads.
- `concat`: HF tensors concatenated along dim 0 as they are (Qwen3.5's `in_proj_qkv`, `in_proj_z`,
  `in_proj_b`, `in_proj_a` -> the same `in_proj`); `Rule.pieces` gives their sizes for the way back.

A vision-language model's language model (Qwen3.5) has its HF tensors under `model.language_model.`
instead of `model.` (its Family's hf_prefix); the rules are the same.

A rule with `sections` is split over TP section by section (every rank holds `[s1_r; s2_r; ...]`,
as megatron's GatedDeltaNet splits its fused in_proj and conv1d), not in one contiguous chunk. With
an attention output gate (Qwen3-Next, `Layout.output_gate`), HF's q_proj holds `[q_h; gate_h]` per
head and `qkv` puts `[q heads of g, gate heads of g, k_g, v_g]` per query group, as megatron's
`attention_output_gate` reads linear_qkv.

Layer indices in the yielded Megatron names are global (0-based), like HF's; the loader maps them
to a pipeline stage's local layers. Expert indices are local to this EP rank.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterable, Iterator

import torch

from rlslurm.errors import ConfigError, DataError
from rlslurm.models.family import Family, family_names, family_of
from rlslurm.models.rules import Kind, Rule
from rlslurm.settings.model_config import ModelConfig


def _under(mc: ModelConfig, rules: list[Rule]) -> list[Rule]:
    """`rules` with their HF names moved under the family's language-model prefix."""
    prefix = _family(mc).hf_prefix
    if prefix == "model.":
        return rules
    return [dataclasses.replace(r, hf=tuple(prefix + h.removeprefix("model.") if h.startswith("model.") else h
                                             for h in r.hf)) for r in rules]


def _family(mc: ModelConfig) -> Family:
    family = family_of(mc.hf_model_type)
    if family is None:
        raise ConfigError(f"model config {mc.name}: hf_model_type={mc.hf_model_type!r} has no HF<->Megatron "
                          f"mapping; supported: {', '.join(family_names())}")
    return family


def _global_rules(mc: ModelConfig) -> list[Rule]:
    rules = [
        Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", tp_dim=0),
        Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    ]
    # Tied: a last pipeline stage still holds an `output_layer.weight` (megatron keeps it in sync
    # with the embedding); it loads from the embedding and is never exported (`lm_head` is absent).
    head = "model.embed_tokens.weight" if mc.arch.tie_word_embeddings else "lm_head.weight"
    rules.append(Rule("output_layer.weight", (head,), "vocab", tp_dim=0))
    return _under(mc, rules)


def layer_rules(mc: ModelConfig, layer: int) -> list[Rule]:
    """The rules of decoder layer `layer` (0-based, global) for mc's family (its `layer_rules`)."""
    return _under(mc, _family(mc).layer_rules(mc, layer))


# Megatron's transformer-engine spec fuses the pre-attention/pre-MLP norms into the following
# linear; its parameter names differ from the local spec's (docs/megatron-cpu.md,
# "Transformer-engine parameter names").
TE_ALIASES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
    "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight",
}
# TE name -> local name where a local name has a second TE name: a gated delta net layer's input norm
# is fused into its in_proj (megatron's get_gated_delta_net_module_spec), not into linear_qkv
TE_REVERSE_EXTRA = {"self_attention.in_proj.layer_norm_weight": "input_layernorm.weight"}

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"local_experts\.(\d+)\.")


def fmt(pattern: str, layer: int | None = None, expert: int | None = None) -> str:
    return pattern.replace("{L}", str(layer)).replace("{E}", str(expert))


# ------------------------------------------------------------------ re-layouts (pure functions)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int, *,
             output_gate: bool = False) -> torch.Tensor:
    """HF q/k/v (weights [n*d, h] or biases [n*d]) -> Megatron linear_qkv, grouped by query group.
    `output_gate`: HF's q holds [q_h; gate_h] per head (Qwen3-Next), megatron wants [q heads of g,
    gate heads of g, k_g, v_g] per group (attention.py get_query_key_value_tensors)."""
    tail = q.shape[1:]
    kg = k.reshape(groups, -1, *tail)
    vg = v.reshape(groups, -1, *tail)
    if output_gate:
        head_dim = kg.shape[1]
        pairs = q.reshape(-1, 2, head_dim, *tail)  # [heads, (q, gate), d, ...]
        qg = pairs[:, 0].reshape(groups, -1, *tail)
        gg = pairs[:, 1].reshape(groups, -1, *tail)
        return torch.cat([qg, gg, kg, vg], dim=1).reshape(-1, *tail)
    qg = q.reshape(groups, -1, *tail)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *tail)


def split_qkv(fused: torch.Tensor, groups: int, heads: int, head_dim: int, *,
              output_gate: bool = False) -> tuple[torch.Tensor, ...]:
    tail = fused.shape[1:]
    per_group = heads // groups * head_dim
    if output_gate:
        g = fused.reshape(groups, 2 * per_group + 2 * head_dim, *tail)
        q, gate, k, v = torch.split(g, [per_group, per_group, head_dim, head_dim], dim=1)
        q = torch.stack([q.reshape(heads, head_dim, *tail), gate.reshape(heads, head_dim, *tail)], dim=1)
        return tuple(x.reshape(-1, *tail).contiguous() for x in (q, k, v))
    g = fused.reshape(groups, per_group + 2 * head_dim, *tail)
    q, k, v = torch.split(g, [per_group, head_dim, head_dim], dim=1)
    return tuple(x.reshape(-1, *tail).contiguous() for x in (q, k, v))


def fuse_gdn_in(qkvz: torch.Tensor, ba: torch.Tensor, key_heads: int, key_dim: int, value_heads: int,
                value_dim: int) -> torch.Tensor:
    """HF Qwen3-Next `in_proj_qkvz` ([q_g, k_g, v_g, z_g] per key head g, v_g/z_g the g-th group of
    value_heads / key_heads value heads) and `in_proj_ba` ([b_g, a_g] per key head;
    Qwen3NextGatedDeltaNet.fix_query_key_value_ordering) -> megatron GatedDeltaNet's in_proj
    [q; k; v; z; b; a], each over all heads in head order."""
    r = value_heads // key_heads
    tail = qkvz.shape[1:]
    q, k, v, z = torch.split(qkvz.reshape(key_heads, -1, *tail), [key_dim, key_dim, r * value_dim, r * value_dim], 1)
    b, a = torch.split(ba.reshape(key_heads, 2 * r, *tail), [r, r], 1)
    return torch.cat([x.reshape(-1, *tail) for x in (q, k, v, z, b, a)], 0)


def split_gdn_in(full: torch.Tensor, key_heads: int, key_dim: int, value_heads: int,
                 value_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_gdn_in`."""
    r = value_heads // key_heads
    tail = full.shape[1:]
    qk, v = key_heads * key_dim, value_heads * value_dim
    q, k, vv, z, b, a = torch.split(full, [qk, qk, v, v, value_heads, value_heads], 0)
    per_head = [x.reshape(key_heads, -1, *tail) for x in (q, k, vv, z)]
    qkvz = torch.cat(per_head, 1).reshape(-1, *tail)
    ba = torch.cat([b.reshape(key_heads, r, *tail), a.reshape(key_heads, r, *tail)], 1).reshape(-1, *tail)
    return qkvz.contiguous(), ba.contiguous()


def _halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = t.shape[0] // 2
    return t[:n], t[n:]


def shard(kind: Kind, full: torch.Tensor, rank: int, size: int, *, partition_dim: int | None,
          sections: tuple[int, ...] = ()) -> torch.Tensor:
    """This TP rank's slice of a full Megatron-layout tensor. partition_dim None = replicated.
    `sections`: split each section over TP and concatenate this rank's pieces (Rule.sections)."""
    if size == 1 or partition_dim is None:
        return full
    if sections:
        if any(n % size for n in sections) or sum(sections) != full.shape[partition_dim]:
            raise ConfigError(f"cannot split sections {sections} of a tensor of shape {tuple(full.shape)} along dim "
                              f"{partition_dim} into {size} TP shards")
        parts = torch.split(full, list(sections), partition_dim)
        return torch.cat([p.chunk(size, partition_dim)[rank] for p in parts], partition_dim)
    if kind == "gate_up":
        gate, up = _halves(full)
        return torch.cat([gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank]], 0)
    if full.shape[partition_dim] % size:
        raise ConfigError(f"cannot split a tensor of shape {tuple(full.shape)} along dim {partition_dim} "
                          f"into {size} TP shards")
    return full.chunk(size, partition_dim)[rank]


def unshard(kind: Kind, parts: list[torch.Tensor], *, partition_dim: int | None,
            sections: tuple[int, ...] = ()) -> torch.Tensor:
    """Inverse of `shard` given every TP rank's slice in rank order."""
    if len(parts) == 1 or partition_dim is None:
        return parts[0]
    if sections:
        local = [n // len(parts) for n in sections]
        pieces = [torch.split(p, local, partition_dim) for p in parts]
        return torch.cat([pieces[r][i] for i in range(len(sections)) for r in range(len(parts))], partition_dim)
    if kind == "gate_up":
        halves = [_halves(p) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
    return torch.cat(parts, partition_dim)


@dataclasses.dataclass(frozen=True)
class Layout:
    """The numbers the re-layouts need."""

    heads: int
    groups: int
    head_dim: int
    vocab: int
    vocab_padded: int
    output_gate: bool = False
    # gated delta net: key heads, key head dim, value heads, value head dim (0: none)
    gdn: tuple[int, int, int, int] = (0, 0, 0, 0)

    @classmethod
    def of(cls, mc: ModelConfig, vocab_padded: int | None = None) -> "Layout":
        a = mc.arch
        d = a.gated_delta_net
        gdn = (d.num_key_heads, d.key_head_dim, d.num_value_heads, d.value_head_dim) if d else (0, 0, 0, 0)
        return cls(a.num_attention_heads, a.num_query_groups, a.kv_channels, a.vocab_size,
                   vocab_padded or a.vocab_size, a.attention_output_gate, gdn)


def to_mcore(rule: Rule, hf: list[torch.Tensor], lay: Layout) -> torch.Tensor:
    """HF tensor(s) of `rule` -> the full (unsharded) Megatron tensor."""
    if rule.kind == "plain":
        return hf[0]
    if rule.kind == "vocab":
        t = hf[0]
        if t.shape[0] != lay.vocab:
            raise DataError(rule.hf[0], f"has {t.shape[0]} rows, model config vocab_size={lay.vocab}")
        if lay.vocab_padded > lay.vocab:
            t = torch.cat([t, t.new_zeros(lay.vocab_padded - lay.vocab, *t.shape[1:])], 0)
        return t
    if rule.kind == "qkv":
        return fuse_qkv(*hf, groups=lay.groups, output_gate=lay.output_gate)
    if rule.kind == "gdn_in":
        return fuse_gdn_in(*hf, *lay.gdn)
    if rule.kind == "concat":
        return torch.cat(hf, 0)
    if rule.kind == "gate_up":
        return hf[0] if len(hf) == 1 else torch.cat(hf, 0)
    raise AssertionError(rule.kind)


def to_hf(rule: Rule, full: torch.Tensor, lay: Layout) -> list[torch.Tensor]:
    """The full Megatron tensor of `rule` -> its HF tensor(s), in `rule.hf` order."""
    if rule.kind == "plain":
        return [full]
    if rule.kind == "vocab":
        return [full[: lay.vocab]]
    if rule.kind == "qkv":
        return list(split_qkv(full, lay.groups, lay.heads, lay.head_dim, output_gate=lay.output_gate))
    if rule.kind == "gdn_in":
        return list(split_gdn_in(full, *lay.gdn))
    if rule.kind == "concat":
        return [x.contiguous() for x in torch.split(full, list(rule.pieces), 0)]
    if rule.kind == "gate_up":
        return [full] if len(rule.hf) == 1 else [x.contiguous() for x in _halves(full)]
    raise AssertionError(rule.kind)


# ------------------------------------------------------------------ name resolution


@dataclasses.dataclass(frozen=True)
class Resolved:
    rule: Rule
    layer: int | None       # global layer index
    expert: int | None      # global expert index
    hf_names: tuple[str, ...]


def resolve(mc: ModelConfig, mcore_name: str, *, layer_map: Callable[[int], int] = lambda i: i,
            expert_offset: int = 0) -> Resolved | None:
    """The rule for a Megatron parameter name (local spec or TE names); None if unmapped.

    `layer_map` turns the name's (stage-local) layer index into the global one; `expert_offset`
    is this EP rank's first global expert.
    """
    for r in _global_rules(mc):
        if r.mcore == mcore_name:
            return Resolved(r, None, None, r.hf)
    m = _LAYER_RE.match(mcore_name)
    if not m:
        return None
    layer = layer_map(int(m.group(1)))
    suffix = m.group(2)
    expert = None
    em = _EXPERT_RE.search(suffix)
    if em:
        expert = expert_offset + int(em.group(1))
        suffix = _EXPERT_RE.sub("local_experts.{E}.", suffix, count=1)
    te_reverse = {**{v: k for k, v in TE_ALIASES.items()}, **TE_REVERSE_EXTRA}
    suffix = te_reverse.get(suffix, suffix)
    for r in layer_rules(mc, layer):
        if r.mcore == suffix:
            return Resolved(r, layer, expert, tuple(fmt(h, layer, expert) for h in r.hf))
    return None


def default_targets(mc: ModelConfig, *, num_local_experts: int | None = None) -> dict[str, int | None]:
    """Every Megatron tensor name of a whole (PP=1, EP=1 unless told) local-spec model -> TP dim.

    For model-free use of `hf_to_mcore` (tests, tools); a live model's own names and split dims
    (`load.load_hf_checkpoint`) take precedence where a model exists.
    """
    out: dict[str, int | None] = {}
    for r in _global_rules(mc):
        if r.mcore == "output_layer.weight" and mc.arch.tie_word_embeddings:
            continue
        out[r.mcore] = r.tp_dim
    for layer in range(mc.arch.num_layers):
        for r in layer_rules(mc, layer):
            n = num_local_experts if num_local_experts is not None else (mc.arch.moe.num_experts if r.expert else 0)
            for e in (range(n) if r.expert else [None]):
                out[f"decoder.layers.{layer}." + fmt(r.mcore, layer, e)] = r.tp_dim
    return out


def expected_hf_names(mc: ModelConfig) -> list[str]:
    """Every HF tensor name the mapping reads for `mc` (for completeness checks)."""
    names = list(dict.fromkeys(h for r in _global_rules(mc) for h in r.hf))
    for layer in range(mc.arch.num_layers):
        for r in layer_rules(mc, layer):
            experts = range(mc.arch.moe.num_experts) if r.expert else [None]
            names += [fmt(h, layer, e) for e in experts for h in r.hf]
    return names


# ------------------------------------------------------------------ streaming import


def hf_to_mcore(
    mc: ModelConfig,
    hf_state: Iterable[tuple[str, torch.Tensor]] | Callable[[str], torch.Tensor],
    tp_rank: int = 0,
    tp_size: int = 1,
    *,
    targets: dict[str, int | None] | None = None,
    vocab_size_padded: int | None = None,
    layer_map: Callable[[int], int] = lambda i: i,
    expert_offset: int = 0,
    tp_override: dict[str, tuple[int, int]] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(megatron_name, local_shard)` for every name in `targets`.

    `targets` maps this rank's Megatron parameter names (as in `model.state_dict()`) to their TP
    partition dim (None: replicated); `load.load_hf_checkpoint` reads them off the model. Default:
    `default_targets(mc)` (whole model, local-spec split dims).
    `hf_state` is either a getter `name -> tensor` (random access: each tensor read once, when
    needed) or an iterator of `(hf_name, tensor)` pairs (streaming: tensors are held only until
    every input of a rule has arrived). `tp_override` gives (rank, size) per name where the TP group
    differs (routed experts under expert tensor parallelism).
    """
    lay = Layout.of(mc, vocab_size_padded)
    if targets is None:
        targets = default_targets(mc)
    plan: dict[str, Resolved] = {}
    for name in targets:
        res = resolve(mc, name, layer_map=layer_map, expert_offset=expert_offset)
        if res is None:
            raise ConfigError(f"model config {mc.name}: Megatron parameter {name!r} has no HF mapping "
                              f"for family {mc.hf_model_type!r} (model built for another architecture?)")
        plan[name] = res

    def emit(name: str, tensors: list[torch.Tensor]) -> tuple[str, torch.Tensor]:
        res = plan[name]
        full = to_mcore(res.rule, tensors, lay)
        rank, size = (tp_override or {}).get(name, (tp_rank, tp_size))
        return name, shard(res.rule.kind, full, rank, size, partition_dim=targets[name], sections=res.rule.sections)

    if callable(hf_state):
        for name, res in plan.items():
            yield emit(name, [hf_state(h) for h in res.hf_names])
        return

    waiting: dict[str, list[str]] = {}  # hf name -> megatron names that need it
    for name, res in plan.items():
        for h in res.hf_names:
            waiting.setdefault(h, []).append(name)
    have: dict[str, torch.Tensor] = {}
    remaining = {name: set(res.hf_names) for name, res in plan.items()}
    for hf_name, tensor in hf_state:
        users = waiting.get(hf_name)
        if not users:
            continue  # another stage's / EP rank's tensor, or one the model does not use (MTP)
        have[hf_name] = tensor
        for name in users:
            remaining[name].discard(hf_name)
            if not remaining[name]:
                yield emit(name, [have[h] for h in plan[name].hf_names])
                del remaining[name]
                for h in plan[name].hf_names:
                    waiting[h].remove(name)
                    if not waiting[h]:
                        have.pop(h, None)
    if remaining:
        missing = sorted({h for hs in remaining.values() for h in hs})
        raise DataError("HF checkpoint", f"{len(missing)} tensor(s) missing, e.g. {missing[:5]}")
