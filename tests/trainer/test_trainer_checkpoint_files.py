"""Checkpoint directory logic without megatron: completeness marks, corruption fallback, keep-K."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlslurm.trainer import checkpoint as ck


def fake_ckpt(root: Path, it: int, *, complete: bool = True, point_latest: bool = True) -> Path:
    d = root / ck.ckpt_name(it)
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(bytes(range(256)) * (it + 1))
    (d / "common.pt").write_bytes(b"common" * it)
    if complete:
        ck.write_meta(d, it, 2, {})
        if point_latest:
            (root / ck.LATEST).write_text(json.dumps({"name": d.name, "iteration": it}))
    return d


def test_latest_intact_is_chosen(tmp_path: Path) -> None:
    fake_ckpt(tmp_path, 2)
    d4 = fake_ckpt(tmp_path, 4)
    assert ck.find_resume(tmp_path) == d4


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "no_meta"])
def test_corrupt_latest_falls_back_loudly(tmp_path: Path, capsys, damage: str) -> None:
    d2 = fake_ckpt(tmp_path, 2)
    d4 = fake_ckpt(tmp_path, 4)
    f = d4 / "__0_0.distcp"
    if damage == "truncate":
        f.write_bytes(f.read_bytes()[:-10])
    elif damage == "flip":
        b = bytearray(f.read_bytes())
        b[7] ^= 1
        f.write_bytes(bytes(b))
    elif damage == "delete":
        f.unlink()
    else:
        (d4 / ck.META).unlink()
    assert ck.find_resume(tmp_path) == d2
    err = capsys.readouterr().err
    assert "WARNING" in err and str(d4) in err and "falling back" in err


def test_incomplete_newer_dir_without_latest_pointer_is_skipped(tmp_path: Path) -> None:
    d2 = fake_ckpt(tmp_path, 2)
    fake_ckpt(tmp_path, 4, complete=False)  # crashed mid-save: no META, latest still on 2
    assert ck.find_resume(tmp_path) == d2


def test_nothing_usable(tmp_path: Path) -> None:
    assert ck.find_resume(tmp_path / "missing") is None
    fake_ckpt(tmp_path, 1, complete=False)
    assert ck.find_resume(tmp_path) is None


def test_prune_keeps_newest_k_and_the_latest(tmp_path: Path) -> None:
    for it in (1, 2, 3, 4):
        fake_ckpt(tmp_path, it)
    fake_ckpt(tmp_path, 5, complete=False)  # an in-progress save is newer: never pruned
    gone = ck.prune(tmp_path, keep=2)
    assert sorted(p.name for p in gone) == ["iter_0000001", "iter_0000002"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000003", "iter_0000004", "iter_0000005", "latest"]
