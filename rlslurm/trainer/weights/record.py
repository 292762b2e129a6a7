"""The transport record: one `Delivered` per publish, naming what delivered the version and whether
the disk fallback did: a fallback that delivers every version must not pass for the transport (tests
assert the record, tests/helpers/deliveries.py). The names are the plan's (rlslurm/settings/weight_plan.py TRANSPORTS,
`delivered_by`); delivery.py writes them into metrics.jsonl, the publishers into
control/weight_version.json, which `rlslurm status` and `rlslurm run` show.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from rlslurm.settings.weight_plan import TRANSPORTS

ERROR_CHARS = 300


@dataclass(frozen=True)
class Delivered:
    """How one publish went: `transport` delivered `version` (the disk `fallback` after the transport's
    tries failed); `engines`: how many engines took it (None: not counted, e.g. a broadcast reaches
    every engine of its group or fails)."""

    version: int
    transport: str
    fallback: bool = False
    tries: int = 1
    seconds: float = 0.0
    engines: int | None = None
    errors: tuple[str, ...] = ()  # why each failed try failed (each cut to ERROR_CHARS)

    def __post_init__(self) -> None:
        assert self.transport in TRANSPORTS, self.transport

    @property
    def reached_none(self) -> bool:
        return self.engines == 0

    def as_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items() if v not in (None, ())}
