"""Human/tool-readable exports of rollouts (JSON Lines, one sample per line)."""

from __future__ import annotations

import json
import math
from typing import Any

from rlslurm.buffer.sample import Rollout, Sample


def sample_to_json(sample: Sample, *, rollout_id: int | None = None) -> dict[str, Any]:
    lp = None
    if sample.rollout_logprobs is not None:
        lp = [None if math.isnan(x) else x for x in sample.rollout_logprobs.tolist()]
    out: dict[str, Any] = {}
    if rollout_id is not None:
        out["rollout_id"] = rollout_id
    out.update(
        index=sample.index,
        group_index=sample.group_index,
        status=sample.status.value,
        reward=sample.reward,
        reward_key=sample.reward_key,
        scalar_reward=sample.scalar_reward,
        weight_version=sample.weight_version,
        label=sample.label,
        prompt_tokens=sample.prompt_tokens.tolist(),
        response_tokens=sample.response_tokens.tolist(),
        response_length=sample.response_length,
        loss_mask=sample.effective_loss_mask().tolist(),
        rollout_logprobs=lp,
        metadata=sample.metadata,
    )
    return out


def export_jsonl(rollout: Rollout) -> bytes:
    lines = [json.dumps(sample_to_json(s, rollout_id=rollout.rollout_id),
                        separators=(",", ":")) for s in rollout.samples]
    return ("\n".join(lines) + "\n").encode()
