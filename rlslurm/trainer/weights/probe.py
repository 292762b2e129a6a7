"""Weight-sync verification (`--verify-weight-sync`): after each publish, the trainer's own greedy
continuation of a fixed prompt is compared with every engine's (temperature 0, same tokens in).

Equal tokens prove the engines hold exactly the trainer's weights (in fp32; bf16 numerics may
diverge after a few tokens: docs/sglang-behaviour.md, "Weight updates"). One exception is allowed:
the probe is batched with the rollout's own requests, and a kernel run at another batch size rounds
differently, which flips a greedy choice only where the two best tokens are tied to within rounding
(seen once in ~25 probes on CPU, docs/sglang-behaviour.md). So where the tokens first differ, an
engine whose two best tokens are the engine's and the trainer's choices, with log-probs within
TIE_LOGPROB of each other, counts as the same (`tie_at` records where). Rank 0 appends one line per version to
RUN/control/weight_probe.jsonl:
{version, trainer, engines: {url: {tokens, top2, weight_version, same[, tie_at]}}, match}.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch

from rlslurm.buffer.control import Control

log = logging.getLogger("rlslurm.trainer")  # the trainer's, where these lines always were

PROBE_NEW_TOKENS = 8


def probe_prompt(vocab_size: int) -> list[int]:
    """A fixed, tokenizer-independent prompt: a few ids spread over the vocabulary."""
    return [(7 + 13 * i) % vocab_size for i in range(6)]


@torch.no_grad()
def trainer_greedy(model: torch.nn.Module, prompt: list[int], vocab_size: int,
                   n_new: int = PROBE_NEW_TOKENS) -> list[int]:
    """Greedy decode with the Megatron model (no KV cache: the prompt is short). Collective over TP
    and PP (every stage runs its layers and gets the last stage's logits)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from rlslurm.trainer.pipeline import logits_on_every_stage

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    try:
        for _ in range(n_new):
            logits = logits_on_every_stage(model, ids)[:, -1, :]
            if ps.model_parallel_is_initialized() and ps.get_tensor_model_parallel_world_size() > 1:
                logits = gather_from_tensor_model_parallel_region(logits)
            logits[:, vocab_size:] = float("-inf")  # Megatron's padded vocabulary rows
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    finally:
        model.train(was_training)
    return ids[0, len(prompt):].tolist()


# Far above the rounding of one fp32 forward (~1e-6), far below a real difference of weights.
TIE_LOGPROB = 1e-3


def tie_at(trainer: list[int], engine: dict) -> int | None:
    """Where an engine's tokens first differ from the trainer's, if that is a near-tie flip (see the
    module docstring); None otherwise."""
    tokens, top2 = engine.get("tokens"), engine.get("top2") or []
    if not tokens or len(tokens) != len(trainer):
        return None
    j = next(i for i, (a, b) in enumerate(zip(tokens, trainer)) if a != b)
    if j >= len(top2) or len(top2[j]) < 2:
        return None
    (lp1, t1), (lp2, t2) = top2[j][:2]
    # Either order: at an exact tie the engine's argmax and its top-k sort need not agree on which
    # of the two comes first.
    return j if {t1, t2} == {tokens[j], trainer[j]} and abs(lp1 - lp2) <= TIE_LOGPROB else None


def record_probe(path: Path, version: int, trainer: list[int], engines: dict[str, dict]) -> dict:
    for e in engines.values():
        if "error" in e:
            continue
        tie = None if e.get("tokens") == trainer else tie_at(trainer, e)
        e["same"] = str(e.get("weight_version")) == str(version) and (e.get("tokens") == trainer or tie is not None)
        if tie is not None:
            e["tie_at"] = tie
    match = bool(engines) and all(e.get("same", False) for e in engines.values())
    rec = {"version": version, "time": time.time(), "trainer": trainer, "engines": engines, "match": match}
    with open(path, "a") as f:  # rank 0 is the only writer
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return rec


def probe_engines(st: Any, control: Control, version: int, *, rank: int, ending: Callable[[], bool]) -> None:
    """Collective over the trainer: every rank runs the greedy forward, rank 0 asks the engines and
    appends the verdict to control/weight_probe.jsonl. `st`: the trainer's state (its model and the
    model config); `ending`: rank 0's "the attempt is ending"."""
    from rlslurm.engines.greedy import engine_greedy

    prompt = probe_prompt(st.mc.arch.vocab_size)
    mine = trainer_greedy(st.actor.model, prompt, st.mc.arch.vocab_size)
    if rank != 0:
        return
    # an engine awaiting weights was restarted after this sync began: it is not serving
    urls = [e.url for e in control.engines() if e.healthy and not e.awaiting_weights]
    if not urls:  # e.g. the only engine, restarted, not yet listed as serving: nothing to compare
        log.info("weight probe v%d not recorded: no engine serves yet (a restarted one still awaits "
                 "its weights); the next sync's probe reads it", version)
        return
    rd = control.run
    key = rd.api_key() if rd.api_key_file.exists() else None
    answers = engine_greedy(urls, key, prompt, PROBE_NEW_TOKENS)
    if any("error" in a for a in answers.values()) and ending():
        # SLURM TERMs every process of the job at once: engines that stopped answering while
        # this attempt ends say nothing about the weights they held (a flaky "mismatch" before)
        log.info("weight probe v%d not recorded: the attempt is ending and engines are going (%s)",
                 version, answers)
        return
    rec = record_probe(rd.control_dir / "weight_probe.jsonl", version, mine, answers)
    (log.info if rec["match"] else log.warning)("weight probe v%d: %s", version,
                                               "engines match" if rec["match"] else rec)
