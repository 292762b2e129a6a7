"""--colocate: which of the trainer's tensor sets leave the GPU while the engines generate, decided per
run when neither --offload-train nor --no-offload-train is given
(docs/colocate.md, "What stays on the GPU").

The sets (trainer/tensor_sets.py) are the actor's params, the gradients, and the rest (optimizer state:
fp32 main params and Adam's moments; ref, critic). A set that moves costs its PCIe copy both ways every
rollout, but the gradients are scratch (dropped and zeroed, never copied), so moving them costs only a
memset; what a set keeps on the GPU comes out of the engines' KV cache, because each engine sizes its
share on the memory free at its start, after the trainer's first offload (engines/memory_share.py). So
the trainer takes the first of CANDIDATES, the cheapest in copies first, for which

    resident + margin + engines' need <= usable

and where not even the last fits, every set moves (--offload-train). Where the rest moves, what of it fits
stays (`Choice.keep_rest`): only the remainder is copied each turn.

- resident: the kept sets' bytes on the GPU, the largest over the ranks. The rest counts Adam's
  moments, which the optimizer makes only at its first step (`pending_optimizer_bytes`).
- margin: engines/memory_share.py `trainer_margin`: one transfer bucket and room to grow, and the
  params when they move (onloaded beside the engines to publish to a restarted engine). Kept, the params
  are already off the engines' share, so keeping them costs the engines nothing more than moving them:
  [params] fits whenever [] does.
- engines' need, per GPU: their weights (the parameter count x the serving dtype's bytes / the engine's
  TP), SGLang's reserve for activations and CUDA graphs (`SGLANG_RESERVE_*`, an estimate: SGLang's own
  heuristic lives in its server_args and needs SGLang, which the trainer's environment need not have;
  docs/sglang-behaviour.md, "How SGLang sizes its memory"), and a KV cache that holds every sample of
  one rollout at its full length at once, the samples spread over the engines (`kv_bytes_per_token`).
- usable: the GPU's size less what neither torch's allocator nor the engines hold (the CUDA context,
  NCCL's buffers), the least over the ranks.

Every input is reduced over the ranks (the largest needs, the least room), so every rank decides the
same and their collectives stay aligned. An estimate that is off costs speed, not memory: the engines'
share is still derived from what is free at their start, so a KV target that was not met gives them a
smaller KV cache (fewer samples in flight), never an out-of-memory. On --device cpu there is no GPU
memory to share: everything stays unless --offload-train asks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

from rlslurm.engines.memory_share import kv_bytes_per_token, kv_dtype_bytes, serving_dtype_bytes

GIB = 2**30
SETS = ("params", "grads", "rest")
# What auto may move, cheapest first: by the bytes a turn copies over PCIe, then by what leaves the GPU.
# The gradients cost no copy (scratch: a qwen3-1.7B run moved 19.2 GiB of optimizer state, 0.9 s a turn,
# to make 0.39 GiB of room its 6.4 GiB of gradients would have made for free; bench/results/
# gpu-lease-2026-12-07c.md). The rest moves with them, and only as much of it as does not fit
# (`Choice.keep_rest`): it is copied both ways. The params never move alone: kept, they are off the
# engines' share already, and moved, the margin holds them for a publish to a restarted engine
# (`trainer_margin`): no room is made.
CANDIDATES: tuple[tuple[str, ...], ...] = ((), ("grads",), ("grads", "rest"))
LABELS = {"params": "params", "grads": "grads", "rest": "optimizer state"}
# SGLang's default reserve (1 - its --mem-fraction-static) x the GPU: 512 MiB + 1.5 x its chunked prefill
# size + 2 x its decode CUDA-graph batch size, about 13 GiB on an 80 GB H100 and a 141 GB H200 alike
# (docs/sglang-behaviour.md); its chunked prefill doubles above 160 GB, which the share covers
SGLANG_RESERVE_MIN_BYTES = 13 * GIB
SGLANG_RESERVE_SHARE = 0.12
# The prompt length assumed where neither --max-prompt-len nor --rollout-max-context-len bounds it
ASSUMED_PROMPT_TOKENS = 1024


@dataclass(frozen=True)
class EnginesNeed:
    """What the engines need on one GPU while they generate (bytes), and how the KV target was made."""

    weights: int
    reserve: int
    kv: int
    samples: int = 0          # per engine
    tokens: int = 0           # per sample at full length
    kv_per_token: int = 0     # bytes on one GPU

    @property
    def total(self) -> int:
        return self.weights + self.reserve + self.kv


@dataclass(frozen=True)
class Choice:
    """The sets that move (`moves`, in SETS order), what `setting` asked, and why, in one line."""

    setting: str              # "auto", "--offload-train", "--no-offload-train"
    moves: tuple[str, ...]
    line: str
    terms_gib: dict[str, float] = field(default_factory=dict)
    auto_keeps: tuple[str, ...] | None = None  # what auto keeps (None: no GPU memory to decide on)
    keep_rest: int = 0  # bytes of the rest that stay on the GPU though it moves (auto: what fits; 0: none)

    @property
    def keeps(self) -> tuple[str, ...]:
        return tuple(s for s in SETS if s not in self.moves)

    def describe(self) -> str:
        """The one line the trainer logs: `offload-train auto: keeps ... resident, moves ... (terms)`."""
        how = {"--offload-train": "on (--offload-train)", "--no-offload-train": "off (--no-offload-train)"}
        return f"offload-train {how.get(self.setting, self.setting)}: {self.line}"


def sglang_reserve(total: int) -> int:
    return max(SGLANG_RESERVE_MIN_BYTES, int(SGLANG_RESERVE_SHARE * total))


def engines_need(cfg: Any, mc: Any, total: int) -> EnginesNeed:
    """The engines' need on one GPU of `total` bytes, from the run's settings and model."""
    r = cfg.rollout
    tp = r.rollout_num_gpus_per_engine
    dtype_bytes = serving_dtype_bytes(cfg)
    kv_bytes = kv_dtype_bytes(cfg)
    prompt = cfg.data.max_prompt_len or ASSUMED_PROMPT_TOKENS
    tokens = prompt + r.rollout_max_response_len
    if r.rollout_max_context_len is not None:
        tokens = r.rollout_max_context_len if cfg.data.max_prompt_len is None else min(tokens,
                                                                                       r.rollout_max_context_len)
    tokens = min(tokens, mc.arch.max_position_embeddings)
    engines = max(1, cfg.rollout_gpus // tp)  # the router spreads a rollout's samples over all of them
    in_flight = max(r.rollout_batch_size, r.over_sampling_batch_size or 0) * r.n_samples_per_prompt
    samples = math.ceil(in_flight / engines)
    per_token = kv_bytes_per_token(mc.arch, tp, kv_bytes)
    return EnginesNeed(weights=mc.num_params * dtype_bytes // tp, reserve=sglang_reserve(total),
                       kv=samples * tokens * per_token, samples=samples, tokens=tokens, kv_per_token=per_token)


def _names(sets: Iterable[str]) -> str:
    return ", ".join(LABELS[s] for s in sets) or "nothing"


def decide(state: dict[str, int], *, usable: int, total: int, need: EnginesNeed, bucket: int) -> Choice:
    """Auto: the first of CANDIDATES that fits beside the engines, else every set (the module's rule); pure."""
    from rlslurm.engines.memory_share import trainer_margin

    for moved in (*CANDIDATES, SETS):
        kept = tuple(s for s in SETS if s not in moved)
        resident = sum(state[s] for s in kept)
        margin = trainer_margin(0 if "params" in kept else state["params"], bucket, total)
        if resident + margin + need.total <= usable:
            break
    # where not even every set moved fits, every set moves all the same (as --offload-train); the line says so
    keep_rest = 0
    if moved == ("grads", "rest"):  # what of the rest fits stays: only the remainder is copied
        keep_rest = max(0, min(state["rest"], usable - resident - margin - need.total))
        resident += keep_rest
    terms = {**{f"trainer_{s}": state[s] / GIB for s in SETS}, "engine_weights": need.weights / GIB,
             "sglang_reserve": need.reserve / GIB, "kv_target": need.kv / GIB, "margin": margin / GIB,
             "usable": usable / GIB, "total": total / GIB, "rest_kept": keep_rest / GIB}
    moves = tuple(s for s in SETS if s not in kept)
    fits = "<=" if resident + margin + need.total <= usable else "> (does not fit even so)"
    why = (f"trainer {' + '.join(f'{LABELS[s]} {state[s] / GIB:.2f}' for s in SETS)} GiB; engines "
           f"{need.total / GIB:.2f} GiB = weights {need.weights / GIB:.2f} + SGLang's reserve {need.reserve / GIB:.2f} "
           f"+ KV {need.kv / GIB:.2f} ({need.samples} samples x {need.tokens} tokens x "
           f"{need.kv_per_token / 1024:.1f} KiB); margin {margin / GIB:.2f} GiB; kept {resident / GIB:.2f} + margin + "
           f"engines = {(resident + margin + need.total) / GIB:.2f} {fits} {usable / GIB:.2f} GiB usable of "
           f"{total / GIB:.2f}")
    if keep_rest:
        what = (f"keeps {_names(kept)} and {keep_rest / GIB:.2f} GiB of the optimizer state resident, moves "
                f"{_names(s for s in moves if s != 'rest')} and its other {(state['rest'] - keep_rest) / GIB:.2f} GiB")
    else:
        what = f"keeps {_names(kept)} resident, moves {_names(moves)}"
    return Choice("auto", moves, f"{what} ({why})", terms, auto_keeps=kept, keep_rest=keep_rest)


def choose(setting: bool | None, state: dict[str, int], auto: Choice | None) -> Choice:
    """The run's choice: the user's flag wins; else `auto` (`decide`), or on --device cpu (`auto` None)
    everything stays."""
    if setting is None and auto is not None:
        return auto
    if setting is None:
        return Choice("auto", (), "keeps params, grads, optimizer state resident, moves nothing (--device cpu: "
                      "no GPU memory to share with the engines)",
                      {f"trainer_{s}": state[s] / GIB for s in SETS})
    flag, moves = ("--offload-train", SETS) if setting else ("--no-offload-train", ())
    line = f"keeps {_names(s for s in SETS if s not in moves)} resident, moves {_names(moves)} (as {flag} asks"
    if auto is not None:
        line += f"; auto would keep {_names(auto.auto_keeps or ())}: {auto.line.split(' (', 1)[1]}"
    else:
        line += ")"
    return Choice(flag, moves, line, auto.terms_gib if auto is not None else {}, auto.auto_keeps if auto else None)


def pending_optimizer_bytes(st: Any, device: Any) -> int:
    """Adam's moments not made yet on `device`: two of each main param the optimizer has no state for
    (torch's and megatron's Adam make them at the first step; a resumed optimizer has them already)."""
    from rlslurm.trainer.tensor_sets import torch_optimizers

    out = 0
    for opt in (st.actor.optimizer, st.critic.optimizer if st.critic is not None else None):
        for o in torch_optimizers(opt):
            for group in o.param_groups:
                out += sum(2 * p.numel() * p.element_size() for p in group["params"]
                           if p.device == device and not o.state.get(p))
    return out


def for_run(setting: bool | None, cfg: Any, st: Any, sets: dict[str, Any], bucket: int) -> Choice:
    """The choice of this run (`choose`) from every rank's sets (`sets`: SETS' TensorSets) and GPU;
    collective: every rank gets the same."""
    import torch
    import torch.distributed as dist

    state = {s: sets[s].nbytes for s in SETS}
    state["rest"] += pending_optimizer_bytes(st, st.device)
    room = None
    if st.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(st.device)
        room = (free + torch.cuda.memory_reserved(st.device), total)  # less the context and NCCL's buffers
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (state, room))
    state = {s: max(e[0][s] for e in every) for s in SETS}
    rooms = [e[1] for e in every if e[1] is not None]
    auto = None
    if rooms:
        usable, total = min(u for u, _ in rooms), min(t for _, t in rooms)
        auto = decide(state, usable=usable, total=total, need=engines_need(cfg, st.mc, total), bucket=bucket)
    return choose(setting, state, auto)


def recheck(moves: tuple[str, ...], keep_rest: int,
            ranks: list[tuple[int, int, dict[str, int]]]) -> tuple[tuple[str, ...], int, str]:
    """Auto, at the end of every turn, before the engines resume (trainer/colocate.py `Colocation._recheck`):
    the engines sized their share on what the trainer held when they started, and left it a margin beside
    that (`room`). What it keeps can grow past that since: state made after the decision that the pending
    moments did not foresee (a ref or critic's, a second optimizer's), or blocks the allocator cannot give
    back. Then the engines' resume runs out of memory. So per rank (`held`: the trainer's GPU memory with
    the moving sets off it, `room`, and each set's bytes on the GPU now), where one holds more than its room
    the trainer moves more, the cheapest first as in CANDIDATES: the gradients where they make the room on
    every rank; else them and as much more of the rest as the rank short of the most needs (`keep_rest`
    shrinks); else every set. Every rank gets the same. Returns the moves, the rest's bytes that stay, and a
    line saying what changed ("" when nothing did)."""
    worst = None
    for held, room, _ in ranks:
        if held > room and (worst is None or held - room > worst[0]):
            worst = (held - room, held, room)
    if worst is None:
        return moves, keep_rest, ""
    new, keep = set(moves), keep_rest
    if "grads" not in new and all(held - sizes["grads"] <= room for held, room, sizes in ranks):
        new.add("grads")
    elif "params" not in new:
        short = [max(0, held - room - (0 if "grads" in new else sizes["grads"])) for held, room, sizes in ranks]
        keep = min([sizes["rest"] - n for (_, _, sizes), n in zip(ranks, short)]
                   + ([keep_rest] if "rest" in new else []))
        new |= {"grads", "rest"}
        if keep < 0:  # a rank short of more than all its rest: the params go too
            new, keep = set(SETS), 0
    out = tuple(s for s in SETS if s in new)
    said = (f"the trainer holds {worst[1] / GIB:.2f} GiB beside the engines, {worst[0] / GIB:.2f} GiB more than "
            f"the {worst[2] / GIB:.2f} GiB they left it")
    if out == tuple(moves) and keep == keep_rest:
        return out, keep, f"{said}, and has nothing left to move"
    rest = LABELS["rest"] + (f" beyond {keep / GIB:.2f} GiB" if keep else "")
    more = [rest if s == "rest" else LABELS[s] for s in out
            if s not in moves or (s == "rest" and keep != keep_rest)]
    kept = [LABELS[s] for s in SETS if s not in out] + ([f"{keep / GIB:.2f} GiB of {LABELS['rest']}"] if keep else [])
    return out, keep, f"{said}: now moves {', '.join(more)} too (keeps {', '.join(kept) or 'nothing'})"
