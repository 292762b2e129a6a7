"""What an offline W&B run wrote: the records of its `run-<id>.wandb` file, read with wandb's own
protobuf types. wandb 0.31 ships no Python reader (its Go core writes the file), so the framing is
read here: LevelDB's log format (32 KiB blocks; each chunk a 7-byte header of CRC32C, length, type
FULL/FIRST/MIDDLE/LAST) after a 7-byte `:W&B` file header."""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _chunks(data: bytes) -> Iterator[bytes]:
    assert data[:4] == b":W&B", "not a W&B transaction log"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if kind == 0 and length == 0:  # zero padding to the end of the block
            pos += (BLOCK - pos % BLOCK) % BLOCK
            continue
        chunk = data[pos:pos + length]
        pos += length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk
            pending = b""


@dataclass
class OfflineRun:
    path: Path
    run_id: str = ""
    project: str = ""
    group: str = ""
    name: str = ""
    config: dict = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)  # one dict per row, "_step" included
    exited: bool = False  # the run's exit record is in the file (run.finish() was written out)

    @property
    def steps(self) -> list[int]:
        return [int(row["_step"]) for row in self.history]


def read_offline_run(run_dir: Path) -> OfflineRun:
    """`run_dir`: one `offline-run-<time>-<id>` directory."""
    from wandb.proto import wandb_internal_pb2 as pb

    (log_file,) = Path(run_dir).glob("run-*.wandb")
    out = OfflineRun(Path(run_dir))
    for chunk in _chunks(log_file.read_bytes()):
        rec = pb.Record()
        rec.ParseFromString(chunk)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out.run_id, out.project, out.group, out.name = (rec.run.run_id, rec.run.project, rec.run.run_group,
                                                            rec.run.display_name)
            for item in rec.run.config.update:  # wandb.init(config=...) travels with the run record
                out.config[item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in rec.config.update:
                out.config[item.key] = json.loads(item.value_json)
        elif kind == "exit":
            out.exited = True
        elif kind == "history":
            out.history.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                                for i in rec.history.item})
    return out


def offline_runs(wandb_dir: Path, run_id: str, *, wait_s: float = 60.0) -> list[OfflineRun]:
    """Every attempt's offline run of `run_id` under a W&B `dir`, oldest first. In a process that
    goes on, `run.finish()` may return before wandb-core has written the file out (measured with
    wandb 0.31: 1 run in 8 had no history rows yet when read at once; 8 of 8 were complete once the
    logging process had exited), so each is read again until its exit record is there."""
    dirs = sorted((Path(wandb_dir) / "wandb").glob(f"offline-run-*-{run_id}"))
    deadline = time.monotonic() + wait_s
    runs = [read_offline_run(d) for d in dirs]
    while not all(r.exited for r in runs) and time.monotonic() < deadline:
        time.sleep(0.2)
        runs = [read_offline_run(d) for d in dirs]
    assert all(r.exited for r in runs), f"wandb did not finish writing {[str(r.path) for r in runs if not r.exited]}"
    return runs
