"""Checkpoint directory logic without megatron: completeness marks, corruption fallback, keep-K."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# at import time: at test time `conftest` in sys.modules is whichever directory's pytest loaded last
from conftest import commit_rollouts

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


@pytest.mark.parametrize("keep_checkpoints", [2, 3])
def test_retention_keeps_what_a_fallback_to_any_kept_checkpoint_trains(tmp_path: Path, capsys,
                                                                       keep_checkpoints: int) -> None:
    """Issue 15 item 7: --keep-trained-rollouts 4 --save-interval 5 and a corrupt newest checkpoint
    fell back to iter_5 and stopped with "rollout 5 was already trained ... and retired". Here the
    trainer's save sequence (META, latest, prune, retention) runs on the real buffer; every kept
    checkpoint but the oldest is then corrupted, and the fallback must find its rollouts."""
    from rlslurm.buffer import RolloutReader, RunDir, TrainerProgress, after_checkpoint
    from rlslurm.errors import ConfigError

    run = RunDir.create(tmp_path / "run")
    root = run.checkpoints_dir
    commit_rollouts(run.path, range(15))
    reader = RolloutReader(run)
    progress = TrainerProgress()
    for rid in range(15):
        progress.record_trained(reader.wait_for(rid, timeout=1))
        if progress.trained_rollouts % 5 == 0:  # --save-interval 5
            d = fake_ckpt(root, progress.trained_rollouts, point_latest=False)
            ck.write_meta(d, progress.trained_rollouts, 1, {"progress": progress.state_dict()})
            (root / ck.LATEST).write_text(json.dumps({"name": d.name, "iteration": progress.trained_rollouts}))
            ck.prune(root, keep_checkpoints)
            after_checkpoint(reader, progress, ck.retention(root, keep_trained=4, export_dir=tmp_path / "export"))
    kept = sorted(p for p in root.iterdir() if p.name.startswith(ck.PREFIX))
    assert len(kept) == keep_checkpoints
    oldest = kept[0]
    for d in kept[1:]:
        f = d / "__0_0.distcp"
        b = bytearray(f.read_bytes())
        b[7] ^= 1
        f.write_bytes(bytes(b))
    assert ck.find_resume(root) == oldest
    assert "falling back" in capsys.readouterr().err
    resumed = TrainerProgress.from_state_dict(json.loads((oldest / ck.META).read_text())["progress"])
    first = resumed.next_rollout_id
    assert first == 15 - 5 * (keep_checkpoints - 1)
    for rid in range(first, 15):
        resumed.record_trained(reader.wait_for(rid, timeout=1))
    # what is before the oldest kept checkpoint went (keep_trained=4 is less than a save interval),
    # each written to --export-retired-rollouts first
    assert reader.committed_ids() == list(range(first, 15))
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == [f"train-{i:08d}.jsonl" for i in range(first)]
    with pytest.raises(ConfigError, match=f"rollout {first - 1} was already trained"):
        reader.wait_for(first - 1, timeout=1)


def test_retention_counts_every_complete_checkpoint_on_disk(tmp_path: Path) -> None:
    fake_ckpt(tmp_path, 10)
    assert ck.retention(tmp_path, keep_trained=8).keep_from == 10
    fake_ckpt(tmp_path, 5)
    fake_ckpt(tmp_path, 15, complete=False)  # a crashed save is never loaded: it does not count
    r = ck.retention(tmp_path, keep_trained=8)
    assert (r.keep_trained, r.keep_from) == (8, 5)
    assert ck.retention(tmp_path / "none", keep_trained=3).keep_from is None
