"""Names and the manifest of committed rollouts.

Layout under RUN/buffer/:

    train/00000042.manifest.json     the commit record: written last, exclusively
    train/00000042.<nonce>.data      samples (codec.py); nonce unique per commit attempt
    eval/...                         the same for evaluation rollouts
    quarantine/<kind>-<id>-<stamp>/  corrupt rollouts, moved aside with reason.json
    trained.json                     last rollout id covered by a trainer checkpoint

A rollout is committed iff its manifest exists. The manifest names its data file with
size and checksum, and carries its own checksum, so a torn or flipped byte anywhere is
detected before a sample reaches the trainer.
"""

from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlslurm.buffer.sample import RolloutMeta, RolloutStats
from rlslurm.errors import DataError

MANIFEST_FORMAT = "rlslurm-manifest-v1"
ID_WIDTH = 8
# used with fullmatch: `$` would also match before a trailing newline
_MANIFEST_RE = re.compile(r"([0-9]+)\.manifest\.json")
_DATA_RE = re.compile(r"([0-9]+)\.([0-9a-f]+)\.data")
KINDS = ("train", "eval")


class CorruptRollout(DataError):
    """A committed rollout whose manifest or data fails verification."""

    def __init__(self, rollout_id: int, where: str, message: str):
        self.rollout_id = rollout_id
        super().__init__(where, f"rollout {rollout_id} is corrupt: {message}")


def manifest_name(rollout_id: int) -> str:
    return f"{rollout_id:0{ID_WIDTH}d}.manifest.json"


def data_name(rollout_id: int, nonce: str) -> str:
    return f"{rollout_id:0{ID_WIDTH}d}.{nonce}.data"


def parse_manifest_name(name: str) -> int | None:
    m = _MANIFEST_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def parse_data_name(name: str) -> int | None:
    m = _DATA_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def kind_dir(buffer_dir: Path, kind: str) -> Path:
    if kind not in KINDS:
        raise ValueError(f"rollout kind must be one of {KINDS}, got {kind!r}")
    return buffer_dir / kind


@dataclass
class Manifest:
    rollout_id: int
    kind: str
    committed_at: float
    data_file: str
    data_size: int
    data_checksum: list[str]  # one per integrity.BLOCK
    checksum_alg: str
    meta: RolloutMeta
    stats: RolloutStats
    writer: dict[str, Any]

    def _body(self) -> dict[str, Any]:
        return {
            "format": MANIFEST_FORMAT,
            "rollout_id": self.rollout_id,
            "kind": self.kind,
            "committed_at": self.committed_at,
            "data": {
                "file": self.data_file,
                "size": self.data_size,
                "checksum": self.data_checksum,
                "checksum_alg": self.checksum_alg,
            },
            "meta": self.meta.to_json(),
            "stats": self.stats.to_json(),
            "writer": self.writer,
        }

    def to_bytes(self) -> bytes:
        body = self._body()
        body["manifest_checksum"] = _self_checksum(body)
        return (json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes, path: Path, rollout_id: int) -> "Manifest":
        try:
            body = json.loads(data)
            claimed = body.pop("manifest_checksum")
            if claimed != _self_checksum(body):
                raise ValueError("manifest checksum mismatch (bit flip or foreign edit)")
            if body["format"] != MANIFEST_FORMAT:
                raise ValueError(f"format {body['format']!r}, expected {MANIFEST_FORMAT!r}")
            if body["rollout_id"] != rollout_id:
                raise ValueError(f"manifest says rollout {body['rollout_id']}, file name says {rollout_id}")
            d = body["data"]
            # The data file is opened, and deleted by retention, as buffer_dir/<file>: only a name the
            # writer makes (data_name) for this rollout, never a path, may come from a manifest.
            if not isinstance(d["file"], str) or parse_data_name(d["file"]) != rollout_id:
                raise ValueError(f"data file name {d['file']!r} is not <{rollout_id:0{ID_WIDTH}d}>.<nonce>.data")
            return cls(
                rollout_id=body["rollout_id"],
                kind=body["kind"],
                committed_at=body["committed_at"],
                data_file=d["file"],
                data_size=d["size"],
                data_checksum=d["checksum"],
                checksum_alg=d["checksum_alg"],
                meta=RolloutMeta.from_json(body["meta"]),
                stats=RolloutStats.from_json(body["stats"]),
                writer=body["writer"],
            )
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise CorruptRollout(rollout_id, str(path), f"bad manifest: {e}") from e


def _self_checksum(body: dict[str, Any]) -> str:
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    return f"{zlib.crc32(canon):08x}"
