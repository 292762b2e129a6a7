"""What killed writers leave (temp files, the data file of a commit that never published its
manifest) is swept at each attempt's start (rlslurm/buffer/sweep.py, called by the rollout driver);
committed rollouts, live writers' fresh files and every real name stay."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

from rlslurm.buffer import Control, RolloutReader, RolloutWriter, RunDir
from rlslurm.buffer.manifest import data_name
from rlslurm.buffer.sweep import MIN_AGE_S, sweep

from .helpers import assert_same, make_meta, make_samples

OLD = time.time() - MIN_AGE_S - 60


def _debris(rd: RunDir) -> dict[str, Path]:
    """What a SIGKILL mid-write leaves: a temp file in every directory with atomic writes, and a
    commit's data file whose manifest never came."""
    w = RolloutWriter(rd)
    (rd.control_dir / "heartbeats").mkdir(parents=True, exist_ok=True)
    rd.checkpoints_dir.mkdir(exist_ok=True)
    paths = {
        "orphan data": w.dir / data_name(5, "dead0123beef"),
        "buffer tmp": w.dir / ".tmp.00000005.manifest.json.123.abcd",
        "control tmp": rd.control_dir / ".tmp.engines.json.123.abcd",
        "heartbeat tmp": rd.control_dir / "heartbeats" / ".tmp.rollout-0.json.9.ffff",
        "checkpoints tmp": rd.checkpoints_dir / ".tmp.latest.77.0000",
        "root tmp": rd.path / ".tmp.FINISHED.5.1234",
    }
    for p in paths.values():
        p.write_bytes(b"x" * 100)
        os.utime(p, (OLD, OLD))
    return paths


def test_sweep_removes_old_debris_and_nothing_else(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path / "run")
    w, r = RolloutWriter(rd), RolloutReader(rd)
    w.commit(0, make_samples(0), make_meta(0))
    Control(rd).set_weight_version(1)
    debris = _debris(rd)
    fresh = w.dir / ".tmp.00000006.data.5.0000"  # a live writer's, seconds old
    fresh.write_bytes(b"y")
    removed = sweep(rd)
    assert sorted(removed) == sorted(debris.values())
    assert not any(p.exists() for p in debris.values()) and fresh.exists()
    assert r.committed_ids() == [0]
    assert_same(r.read(0), make_samples(0))
    assert Control(rd).weight_version().version == 1


def test_the_driver_sweeps_at_its_start(tmp_path: Path) -> None:
    """An engine-free driver (--debug-train-only, SFT) on a run directory with a killed commit's debris:
    gone once the driver has started, and the rollout is committed under the same id."""
    from rlslurm.rollout.driver import RolloutDriver
    from rlslurm.rollout.sft import SFT_ROLLOUT_FN
    from rlslurm.settings.config import RunConfig
    from tests.rollout.chat_tokenizer import CONV, make_tokenizer

    data = tmp_path / "c.jsonl"
    data.write_text("".join(json.dumps({"messages": CONV}) + "\n" for _ in range(2)))
    rd = RunDir.create(tmp_path / "run")
    debris = _debris(rd)
    cfg = RunConfig.model_validate({
        "rollout": {"num_rollout": 1, "rollout_batch_size": 2, "n_samples_per_prompt": 1,
                    "rollout_function_path": SFT_ROLLOUT_FN},
        "data": {"prompt_data": str(data), "input_key": "messages", "rollout_shuffle": False},
        "train": {"debug_train_only": True, "loss_type": "sft_loss"}})
    driver = RolloutDriver(cfg, rd, router_url=None, engine_urls=lambda: [], api_key=None, tokenizer=make_tokenizer(),
                           poll_s=0.02)
    result = asyncio.run(driver.run())
    assert result.committed == [0]
    assert not [n for n, p in debris.items() if p.exists()]


def test_a_killed_disk_publish_leaves_no_model_copy_behind(tmp_path: Path) -> None:
    """A disk publish builds the model in weights/.tmp-v<N>-<pid>/ and renames it into place
    (trainer/weights/disk.py `export_hf`); killed before the rename, that copy (a whole model) stayed
    forever. The sweep removes it once no file in it is recent; a live export and the versions stay."""
    from rlslurm.buffer.sweep import EXPORT_TMP_PREFIX

    rd = RunDir.create(tmp_path / "run")
    killed = rd.weights_dir / f"{EXPORT_TMP_PREFIX}v3-4242"
    live = rd.weights_dir / f"{EXPORT_TMP_PREFIX}v4-4343"
    version = rd.weights_dir / "v2"
    for d in (killed, live, version):
        d.mkdir(parents=True)
        (d / "model-00001.safetensors").write_bytes(b"w" * 1000)
    for p in (killed, killed / "model-00001.safetensors", version, version / "model-00001.safetensors"):
        os.utime(p, (OLD, OLD))
    os.utime(live, (OLD, OLD))  # its directory is old, the shard it writes now is not
    assert sweep(rd) == [killed]
    assert not killed.exists() and live.exists() and version.exists()
