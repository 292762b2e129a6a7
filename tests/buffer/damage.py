"""Ways to damage a committed rollout's files on disk (tests/buffer/test_corruption.py, and the
driver's quarantine test in tests/rollout): each damages rollout `rid` of writer `w` and returns
the path it damaged, which the reader's error must name."""

from __future__ import annotations

import os

from rlslurm.buffer import RolloutWriter


def _data_file(w: RolloutWriter, rid: int):
    return w.dir / w.manifest(rid).data_file


def truncate(w, rid):
    p = _data_file(w, rid)
    os.truncate(p, p.stat().st_size - 100)
    return p


def flip_data_middle(w, rid):
    p = _data_file(w, rid)
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0x10
    p.write_bytes(bytes(b))
    return p


def flip_data_header(w, rid):
    p = _data_file(w, rid)
    b = bytearray(p.read_bytes())
    b[20] ^= 0x01
    p.write_bytes(bytes(b))
    return p


def append_garbage(w, rid):
    p = _data_file(w, rid)
    with open(p, "ab") as f:
        f.write(b"\0")
    return p


def delete_data(w, rid):
    p = _data_file(w, rid)
    p.unlink()
    return p


def flip_manifest(w, rid):
    p = w.manifest_path(rid)
    b = bytearray(p.read_bytes())
    i = b.index(b'"reward_mean":') + len(b'"reward_mean":') + 2
    b[i] = ord("7") if b[i] != ord("7") else ord("3")  # still valid JSON, wrong number
    p.write_bytes(bytes(b))
    return p


def tear_manifest(w, rid):
    p = w.manifest_path(rid)
    os.truncate(p, 40)
    return p
