from __future__ import annotations

import os

import pytest

from rlslurm.buffer.atomic import publish_exclusive, read_json, write_bytes_atomic, write_json_atomic
from rlslurm.errors import DataError


def test_write_json_roundtrip_leaves_no_temp(tmp_path):
    p = tmp_path / "x.json"
    assert read_json(p) is None
    write_json_atomic(p, {"a": 1})
    write_json_atomic(p, {"a": 2, "b": [1, 2]})
    assert read_json(p) == {"a": 2, "b": [1, 2]}
    assert os.listdir(tmp_path) == ["x.json"]


def test_read_json_names_corrupt_file(tmp_path):
    p = tmp_path / "bad.json"
    p.write_bytes(b'{"a": 1')
    with pytest.raises(DataError, match=str(p)):
        read_json(p)
    p.write_bytes(b"[1]")
    with pytest.raises(DataError, match="JSON object"):
        read_json(p)


def test_json_refuses_nan(tmp_path):
    with pytest.raises(ValueError):
        write_json_atomic(tmp_path / "n.json", {"x": float("nan")})
    assert os.listdir(tmp_path) == []


def test_publish_exclusive_first_wins(tmp_path):
    p = tmp_path / "once"
    assert publish_exclusive(p, b"first")
    assert not publish_exclusive(p, b"second")
    assert p.read_bytes() == b"first"
    assert os.listdir(tmp_path) == ["once"]


def test_write_bytes_replaces(tmp_path):
    p = tmp_path / "f"
    write_bytes_atomic(p, b"a" * 10)
    write_bytes_atomic(p, memoryview(b"bc"))
    assert p.read_bytes() == b"bc"
