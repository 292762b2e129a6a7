"""--load-debug-rollout-data-subsample F: train on a fraction of each replayed rollout (slime's flag).

slime keeps the first and the last halves of int(n * F) samples. Here whole prompt groups are kept
(a group-baseline estimator needs every sample of a group), int(groups * F) of them: the first
ceil(k / 2) and the last floor(k / 2), in buffer order. The kept samples are the trained batch, so
--rollout-batch-size x --n-samples-per-prompt must equal their number (checked at submit,
`check_subsample`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rlslurm.buffer.sample import Rollout
from rlslurm.errors import ConfigError, DataError
from rlslurm.settings.config import RunConfig

FLAG = "--load-debug-rollout-data-subsample"


def kept_groups(n_groups: int, fraction: float) -> list[int]:
    """Positions (0-based, in first-appearance order) of the groups kept out of `n_groups`."""
    k = int(n_groups * fraction)
    head = k - k // 2
    return list(range(head)) + list(range(n_groups - k // 2, n_groups))


def subsample(rollout: Rollout, fraction: float) -> Rollout:
    order = list(dict.fromkeys(s.group_index for s in rollout.samples))
    keep = {order[i] for i in kept_groups(len(order), fraction)}
    if not keep:
        raise DataError(f"rollout {rollout.rollout_id}", f"{FLAG} {fraction:g} keeps none of its {len(order)} groups")
    return dataclasses.replace(rollout, samples=[s for s in rollout.samples if s.group_index in keep])


def check_subsample(cfg: RunConfig) -> None:
    """Submit: the fraction needs a replay, and what it keeps of the replayed buffer's first rollout
    must be the configured batch (rollout-batch-size x n-samples-per-prompt)."""
    f, src = cfg.train.load_debug_rollout_data_subsample, cfg.train.load_debug_rollout_data
    if f is None:
        return
    if src is None:
        raise ConfigError(f"{FLAG} {f:g} subsamples a replayed buffer: it needs --load-debug-rollout-data RUN")
    if not Path(src).is_dir():
        return  # the replay check names the missing directory
    from rlslurm.buffer.reader import RolloutReader

    reader = RolloutReader.replay(src)
    first = reader.committed_ids()[0]
    m = reader.manifest(first)
    if m is None:
        return
    n_groups, n_samples = m.stats.n_groups, m.stats.n_samples
    k = len(kept_groups(n_groups, f))
    r = cfg.rollout
    want = r.rollout_batch_size * r.n_samples_per_prompt
    if k == 0:
        raise ConfigError(f"{FLAG} {f:g} keeps none of the {n_groups} groups of {src}'s rollout {first}")
    if n_samples % n_groups == 0 and k * (n_samples // n_groups) != want:
        raise ConfigError(
            f"{FLAG} {f:g} keeps {k} of the {n_groups} groups ({k * (n_samples // n_groups)} samples) of {src}'s "
            f"rollout {first}, but --rollout-batch-size {r.rollout_batch_size} x --n-samples-per-prompt "
            f"{r.n_samples_per_prompt} = {want}: set --rollout-batch-size {k} --n-samples-per-prompt "
            f"{n_samples // n_groups}")
