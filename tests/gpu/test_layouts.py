"""The GPU layout matrix (issue 30) through `rlslurm run --demo` on a machine of 4 GPUs: each layout puts
the trainer and the engines on GPUs of their own and proves the mechanism, not only the outcome (the disk
fallback gives the same probes and rewards):

* the transport: every version delivered by the NCCL broadcast group, never by the fallback
  (`--weight-sync-fallback off`: a failed sync fails the run instead), read from metrics.jsonl;
* the GPUs: nvidia-smi's own list of which process holds which GPU, mid-run; the trainer ranks' and the
  engines' GPUs are disjoint and are the ones the run recorded (env-trainer-*.json, engines.json);
* every probe at the trainer's version, and the lineage (each rollout trained once).

The engines' loader is the product's default (`--update-weight-receiver auto`: rlslurm's receiver for these
qwen3 runs on GPUs of their own, settings in weight_plan.py); RLSLURM_GPU_RECEIVER=sglang or =rlslurm names
one. Where the run resolved to rlslurm's receiver (engines/receiver.py) the test asserts it loaded the weights:
its line per request in the engines' logs, once per engine rank and published version at least, and every
bucket by learnt copies (none left to SGLang's load_weights).

Layouts: trainer TP2 + one TP2 engine (one NCCL group of world 3), trainer DP2 + two TP1 engines (world 3),
trainer PP2 + one engine (a group per stage, world 2 each). In the TP2 one the engine's server is killed
(kill -9) mid-run: its supervisor restarts it, the trainer syncs it again, and since the run is synchronous
every rollout is generated from the weights of the rollout before it. The colocated layouts are in
test_gpu_grpo.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlslurm.buffer.control import Control
from rlslurm.buffer.rundir import RunDir
from rlslurm.settings.runfile import load_run_config
from tests.gpu.bundle_flags import run_flags
from tests.gpu.run_checks import finish, logs, probes, who_is_on_which_gpu
from tests.helpers.deliveries import assert_delivered_by, final_lineage

NUM_ROLLOUT = 10
RECEIVER = os.environ.get("RLSLURM_GPU_RECEIVER", "auto")

# name: (flags after `rlslurm run --demo --device cuda`, GPUs needed, kill the engine mid-run)
LAYOUTS = {
    "trainer-tp2-engine-tp2": (["--gpus-per-node", "2", "--trainer-procs-per-node", "2",
                                "--tensor-model-parallel-size", "2", "--rollout-num-gpus-per-engine", "2"], 4, True),
    "trainer-dp2-two-engines": (["--gpus-per-node", "2", "--trainer-procs-per-node", "2"], 4, False),
    "trainer-pp2-one-engine": (["--gpus-per-node", "1", "--trainer-procs-per-node", "2",
                                "--pipeline-model-parallel-size", "2"], 3, False),
}










def recorded_gpus(run_dir: Path) -> dict[str, set[str]]:
    """The GPUs the run recorded: each trainer rank's (its env report, from torch) and each engine rank's
    (engines.json, from the rollout node's CUDA_VISIBLE_DEVICES through nvidia-smi)."""
    attempt = max(run_dir.glob("logs/attempt-*"), key=lambda p: int(p.name.split("-")[1]))
    trainer = {json.loads(p.read_text())["gpu_uuid"] for p in attempt.glob("env-trainer-*.json")}
    engines = {u for e in Control(RunDir(run_dir)).engines() for u in e.gpu_uuids}
    return {"trainer": trainer, "engines": engines}


def start(run_dir: Path, log: Path, flags: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rlslurm.cli", "run", "--demo", "--run-dir", str(run_dir), "--no-progress",
           "--device", "cuda", "--num-rollout", str(NUM_ROLLOUT), "--save-interval", "4", "--verify-weight-sync",
           "--rollout-dtype", "bfloat16", "--weight-sync-fallback", "off", "--weight-sync-timeout-s", "60",
           *run_flags(), "--update-weight-receiver", RECEIVER, *flags]
    return subprocess.Popen(cmd, stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)


def receiver_lines(run_dir: Path) -> tuple[int, list[str]]:
    """rlslurm's receiver in the engines' logs: its requests (one line per engine rank and publish) and
    the buckets it left to SGLang's load_weights (it could not learn their copies)."""
    text = "\n".join(p.read_text(errors="replace") for p in run_dir.glob("logs/**/*.log*") if p.is_file())
    requests = sum(1 for l in text.splitlines() if "rlslurm receiver:" in l and "buckets broadcast" in l)
    return requests, [l for l in text.splitlines() if "keeps SGLang's load_weights" in l]


def trained(run_dir: Path) -> int:
    return len(final_lineage(run_dir))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_syncs_over_nccl_on_gpus_of_its_own(name: str, tmp_path: Path) -> None:
    import torch

    flags, need, kill = LAYOUTS[name]
    if torch.cuda.device_count() < need:
        pytest.skip(f"{name} needs {need} GPUs, {torch.cuda.device_count()} here")
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    proc = start(run_dir, log, flags)
    deadline = time.monotonic() + 480
    seen: dict[str, set[str]] = {}
    killed = None
    while proc.poll() is None:
        assert time.monotonic() < deadline, logs(run_dir, log)
        if trained(run_dir) >= 2 and not seen:
            seen = who_is_on_which_gpu(run_dir)  # mid-run: every process holds its GPU now
        if kill and killed is None and trained(run_dir) >= 4:
            [engine] = Control(RunDir(run_dir)).engines()
            os.kill(engine.pid, signal.SIGKILL)  # the server itself, as `kill -9 <pid>` would
            killed = (engine.url, engine.pid, trained(run_dir))
        time.sleep(0.5)
    assert finish(proc, run_dir, log, 60) == 0, logs(run_dir, log)

    # the GPUs: nvidia-smi's view, disjoint, and the ones the run recorded
    recorded = recorded_gpus(run_dir)
    assert seen["trainer"] and seen["engines"] and not seen["trainer"] & seen["engines"], seen
    assert seen["trainer"] == recorded["trainer"] and seen["engines"] <= recorded["engines"], (seen, recorded)
    # the transport: each version over NCCL, none by the fallback (which is off: a failed sync fails the run)
    recs = assert_delivered_by(run_dir, "nccl", versions=set(range(1, NUM_ROLLOUT + 1)))
    if load_run_config(run_dir).train.update_weight_receiver == "rlslurm":  # loaded by its learnt copies
        requests, kept = receiver_lines(run_dir)
        print(f"{name}: rlslurm receiver answered {requests} requests for {len(recs)} publishes; "
              f"{len(kept)} bucket(s) left to load_weights", flush=True)
        assert requests >= len(recs) and not kept, (requests, len(recs), kept[:3])
    assert final_lineage(run_dir) == list(range(NUM_ROLLOUT))
    ps = probes(run_dir)
    assert ps and all(str(e.get("weight_version")) == str(p["version"]) for p in ps for e in p["engines"].values()), \
        ps[:2]
    assert NUM_ROLLOUT in {p["version"] for p in ps}
    engines = Control(RunDir(run_dir)).engines()
    if killed is not None:
        url, old_pid, at = killed
        [e] = [e for e in engines if e.url == url]
        assert e.restarts == 1 and e.pid != old_pid, e
        # synced again after the restart: a probe of a later version found it at the trainer's weights
        assert any(url in p["engines"] and p["version"] > at for p in ps), ps[-3:]
        # synchronous: every sample of rollout k came from weight version k, across the restart
        lines = [json.loads(l) for l in (run_dir / "rollout_metrics.jsonl").read_text().splitlines()]
        train = [(l["rollout_id"], l["rollout/weight_version_min"], l["rollout/weight_version_max"])
                 for l in lines if l["kind"] == "train"]
        assert train and all(lo == hi == rid for rid, lo, hi in train), train
    print(f"{name}: GPUs trainer {sorted(seen['trainer'])} engines {sorted(seen['engines'])}; {len(recs)} publishes "
          f"over nccl, {sum(d['seconds'] for d in recs) / len(recs):.3f} s mean; {len(ps)} probes at the trainer's "
          f"version, greedy equal in {sum(p['match'] for p in ps)}" + (f"; engine killed after {killed[2]} rollouts, "
                                                                     "restarted and synced again" if killed else ""))
