"""Broadcast weight sync from a PP=2 trainer (gloo) into two real CPU SGLang engines: one
weight-update group per pipeline stage, each stage's leader sending its own layers; after each
version both engines' greedy continuation of the probe equals the pipelined trainer's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import HERE, torchrun

pytestmark = [pytest.mark.sglang, pytest.mark.megatron, pytest.mark.slow]


def test_pp2_broadcast_reaches_engines(tmp_path: Path, tiny_hf: Path) -> None:
    from rlslurm.buffer.control import Control
    from rlslurm.buffer.rundir import RunDir
    from rlslurm.engines.supervisor import control_publisher
    from rlslurm.engines.update_watch import UpdateWatcher
    from tests.helpers.sglang_deploy import deploy

    run = RunDir.create(tmp_path / "run")
    control = Control(run)
    with deploy(tiny_hf, run.attempt_log_dir(0), api_key=run.ensure_api_key(),
                extra_args=("--weight-version", "0", "--mem-fraction-static", "0.2"),
                on_change=control_publisher(control, "node0")) as dep:
        watcher = UpdateWatcher(control, dep.supervisor, cap_s=120.0, poll_s=0.05).start()
        try:
            out = tmp_path / "out"
            p = torchrun([str(HERE / "pp_sync_worker.py"), "--hf", str(tiny_hf), "--run-dir", str(run.path),
                          "--out", str(out)], 2, timeout=400)
            (tmp_path / "worker.log").write_text(p.stdout + p.stderr)
            assert p.returncode == 0, "\n".join(l for l in p.stderr.splitlines() if l.startswith("[rank"))[-6000:]
        finally:
            watcher.close()
        restarts = list(dep.restarts)
    res = json.loads((out / "result.json").read_text())
    assert not restarts, restarts  # no engine was restarted while blocked in a broadcast
    seen = {tuple(res["before"])}
    for v in res["versions"]:
        assert v["history"]["transport"] == "gloo" and not v["history"].get("fallback"), v
        assert v["history"]["tries"] == 1 and "errors" not in v["history"], v
        assert (v["recorded"], v["recorded_transport"]) == (v["version"], "gloo")
        assert len(v["engines"]) == 2, v
        for url, e in v["engines"].items():
            assert e.get("tokens") == v["trainer"], (url, v)
            # the probe's near-tie rule reads the engine's top two per token (engines/greedy.py)
            assert [pos[0][1] for pos in e["top2"]] == e["tokens"] and all(
                len(pos) == 2 and pos[0][0] >= pos[1][0] for pos in e["top2"]), (url, e["top2"])
            assert str(e.get("weight_version")) == str(v["version"]), (url, v)
        seen.add(tuple(v["trainer"]))
    assert len(seen) == 3  # each version changed the model's greedy output: the probe can fail
