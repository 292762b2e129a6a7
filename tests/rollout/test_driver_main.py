"""`python -m rlslurm.rollout.main` in local mode (no SLURM env: node 0 of 1): one real CPU
SGLang server, the real router and the driver, from RUN/run.yaml to a committed rollout,
control files, heartbeats, and a clean exit on a stop request."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from rlslurm.buffer.control import Control
from rlslurm.buffer.reader import RolloutReader
from rlslurm.buffer.rundir import RunDir
from rlslurm.settings.config import DataSection, ModelSection, RolloutSection, RunConfig, RunSection, SlurmSection
from rlslurm.settings.runfile import dump_run_config
from tests.helpers.process_groups import argvs, pid_alive
from tests.rollout.helpers import start_rollout_main


def _run_dir(tmp_path: Path, **model) -> RunDir:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"say {c}", "label": c}) + "\n" for c in "abcdef"))
    cfg = RunConfig(run=RunSection(device="cpu"), slurm=SlurmSection(gpus_per_node=0),
                    model=ModelSection(model="tiny-qwen3", **model),
                    data=DataSection(prompt_data=prompts),
                    rollout=RolloutSection(num_rollout=2, rollout_batch_size=2, n_samples_per_prompt=2,
                                           rollout_max_response_len=6, rm_type="exact", engines_per_node=1,
                                           rollout_dtype="float32", engine_health_interval_s=2.0),
                    sglang_args=["--max-total-tokens", "4096", "--mem-fraction-static", "0.3"],
                    router_args=["--policy", "cache_aware"])
    rd = RunDir.create(tmp_path / "run")
    rd.ensure_api_key()
    rd.run_yaml.write_text(dump_run_config(cfg))
    return rd


def test_without_a_checkpoint_no_engine_starts_and_stop_ends_it(tmp_path):
    rd = _run_dir(tmp_path)
    proc = start_rollout_main(rd)
    try:
        deadline = time.monotonic() + 60
        while not Control(rd).heartbeats():  # it is alive and waiting
            assert proc.poll() is None and time.monotonic() < deadline, (rd.path / "rollout.log").read_text()
            time.sleep(0.2)
        assert (rd.path / "logs/attempt-0/env-rollout-0.json").exists()
        Control(rd).request_stop("test")
        time.sleep(3)
        assert proc.poll() is None, "a stop ends the rollout group only once the trainer has acknowledged it"
        Control(rd).ack_stop(checkpoint_iteration=0)  # what the trainer writes after its last save
        assert proc.wait(timeout=60) == 0, (rd.path / "rollout.log").read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    assert Control(rd).engines() == [] and Control(rd).router() is None
    assert "rollout engines not started: no --hf-checkpoint" in (rd.path / "rollout.log").read_text()


@pytest.mark.sglang
@pytest.mark.slow
def test_local_rollout_node_commits_publishes_and_exits_on_stop(tmp_path, tiny_model):
    from rlslurm.engines import sglang_cpu

    if sglang_cpu.installed_sglang_version() is None:
        pytest.skip("sglang is not installed")
    rd = _run_dir(tmp_path, hf_checkpoint=tiny_model)
    proc = start_rollout_main(rd)
    reader = RolloutReader(rd)
    control = Control(rd)
    try:
        deadline = time.monotonic() + 400
        while not reader.is_committed(0):
            assert proc.poll() is None, (rd.path / "rollout.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (rd.path / "rollout.log").read_text()[-3000:]
            time.sleep(0.5)
        [engine] = control.engines()
        assert engine.healthy and engine.url.startswith("http://127.0.0.1:") and engine.restarts == 0
        router = control.router()
        assert router is not None and router.url.startswith("http://127.0.0.1:")
        # --router-policy from run.yaml reached the router's command line, after rlslurm's default
        found = [a for _, a in argvs() if b"sglang_router.launch_router" in a
                 and router.url.rsplit(":", 1)[1].encode() in a]  # the launcher, and its process if it forks
        assert found and all(a[len(a) - a[::-1].index(b"--policy")] == b"cache_aware" for a in found), found
        assert any(hb.role == "rollout" and hb.rank == 0 for hb in control.heartbeats())
        assert len(reader.read(0).samples) == 4
        time.sleep(3)
        assert not reader.is_committed(1)  # sync mode: rollout 1 waits for weight version 1
        control.request_stop("test")
        time.sleep(3)  # the engines stay until the trainer's ack (a sync may still be in flight)
        assert proc.poll() is None and pid_alive(engine.pid)
        control.ack_stop(checkpoint_iteration=0)
        assert proc.wait(timeout=60) == 0, (rd.path / "rollout.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    deadline = time.monotonic() + 10
    while pid_alive(engine.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not pid_alive(engine.pid), "the engine outlived the rollout node"


def test_engine_specs_per_device(tmp_path):
    from rlslurm.errors import ConfigError
    from rlslurm.rollout.node import engine_specs

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    cfg = RunConfig(slurm=SlurmSection(gpus_per_node=8), model=ModelSection(hf_checkpoint=ckpt),
                    rollout=RolloutSection(rollout_num_gpus_per_engine=2, rollout_dtype="bfloat16"),
                    sglang_args=["--mem-fraction-static", "0.8", "--weight-version", "x"])
    specs = engine_specs(cfg, node=3, host="127.0.0.1", api_key="k", log_dir=tmp_path)
    assert [(s.name, s.base_gpu_id, s.tp_size) for s in specs] == [
        ("engine-3-0", 0, 2), ("engine-3-1", 2, 2), ("engine-3-2", 4, 2), ("engine-3-3", 6, 2)]
    args = specs[0].server_args()
    assert args[-2:] == ["--weight-version", "0"]  # ours last: the driver's gate needs integer versions
    assert "--mem-fraction-static" in args and specs[0].dtype == "bfloat16" and specs[0].cpu_core is None
    assert len({s.port for s in specs}) == 4

    cpu = cfg.model_copy(deep=True)
    cpu.run.device = "cpu"
    cpu.rollout.rollout_num_gpus_per_engine = 1
    cpu.rollout.engines_per_node = 3
    specs = engine_specs(cpu, node=0, host="127.0.0.1", api_key="k", log_dir=tmp_path, ncpu=2)
    assert [(s.cpu_core, s.tp_size, s.device) for s in specs] == [(0, 1, "cpu"), (1, 1, "cpu"), (0, 1, "cpu")]
    # cores are numbered across nodes: virtual nodes on one host do not all pin engine 0 to core 0
    cpu.rollout.engines_per_node = 1
    assert [engine_specs(cpu, node=k, host="127.0.0.1", api_key="k", log_dir=tmp_path, ncpu=2)[0].cpu_core
            for k in range(3)] == [0, 1, 0]

    bad = cfg.model_copy(deep=True)
    bad.rollout.rollout_num_gpus_per_engine = 3
    with pytest.raises(ConfigError, match="--gpus-per-node 8 is not a multiple of --rollout-num-gpus-per-engine 3"):
        engine_specs(bad, node=0, host="127.0.0.1", api_key="k", log_dir=tmp_path)
    bad.model.hf_checkpoint = None
    with pytest.raises(ConfigError, match="--hf-checkpoint is required"):
        engine_specs(bad, node=0, host="127.0.0.1", api_key="k", log_dir=tmp_path)

    # --nodes 1: the engines use the rollout's share of the node (--rollout-gpus), numbered from 0 in
    # the rollout step's own CUDA_VISIBLE_DEVICES (rlslurm/gpus.py)
    one = cfg.model_copy(deep=True)
    one.slurm.nodes, one.slurm.trainer_gpus, one.slurm.rollout_gpus = 1, 4, 4
    assert [(s.base_gpu_id, s.tp_size) for s in engine_specs(one, node=0, host="127.0.0.1", api_key="k",
                                                             log_dir=tmp_path)] == [(0, 2), (2, 2)]
    one.slurm.rollout_gpus = 3
    with pytest.raises(ConfigError, match="--rollout-gpus 3 is not a multiple of --rollout-num-gpus-per-engine 2"):
        engine_specs(one, node=0, host="127.0.0.1", api_key="k", log_dir=tmp_path)


def test_engine_specs_spanning_nodes(tmp_path):
    """An engine of 16 GPUs on 8-GPU nodes: rollout nodes 0-1 and 2-3 each run one, named after its first
    node; every node runs its rank (engines/span.py). On CPU an engine of N ranks spans N nodes."""
    from rlslurm.engines.engine import EngineSpec
    from rlslurm.errors import ConfigError
    from rlslurm.rollout.node import engine_specs, engines_total, nodes_per_engine

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    cfg = RunConfig(slurm=SlurmSection(gpus_per_node=8, rollout_nodes=4), model=ModelSection(hf_checkpoint=ckpt),
                    rollout=RolloutSection(rollout_num_gpus_per_engine=16))
    assert (nodes_per_engine(cfg), engines_total(cfg)) == (2, 2)
    specs = [engine_specs(cfg, node=k, host="127.0.0.1", api_key="k", log_dir=tmp_path)[0] for k in range(4)]
    assert [(s.name, s.node_rank, s.nnodes, s.tp_size, s.base_gpu_id) for s in specs] == [
        ("engine-0-0", 0, 2, 16, 0), ("engine-0-0", 1, 2, 16, 0), ("engine-2-0", 0, 2, 16, 0),
        ("engine-2-0", 1, 2, 16, 0)]
    assert [s.log_path.name for s in specs[:2]] == ["engine-0-0.log", "engine-0-0-rank1.log"]
    with pytest.raises(ConfigError, match="needs its dist-init address"):
        specs[1].server_args()
    args = EngineSpec(**{**specs[1].__dict__, "dist_init_addr": "10.0.0.1:23456"}).server_args()
    i = args.index("--nnodes")
    assert args[i:i + 6] == ["--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.1:23456"]
    assert args[args.index("--tp-size") + 1] == "16"

    cpu = cfg.model_copy(deep=True)
    cpu.run.device, cpu.rollout.rollout_num_gpus_per_engine, cpu.rollout.engines_per_node = "cpu", 2, 1
    cpu.slurm.rollout_nodes = 2
    specs = [engine_specs(cpu, node=k, host="127.0.0.1", api_key="k", log_dir=tmp_path, ncpu=2)[0] for k in range(2)]
    assert [(s.node_rank, s.tp_size, s.cpu_core) for s in specs] == [(0, 2, 0), (1, 2, 1)]
    # each rank binds its OpenMP threads to its own core, whichever entry SGLang reads
    assert [s.env({})["SGLANG_CPU_OMP_THREADS_BIND"] for s in specs] == ["0|0", "1|1"]


def test_node_zero_merges_every_nodes_engines(tmp_path):
    from rlslurm.engines.supervisor import EngineInfo
    from rlslurm.rollout.node import RolloutNode

    rd = _run_dir(tmp_path)
    cfg = RunConfig()

    def info(url: str, restarts: int = 0) -> EngineInfo:
        return EngineInfo(name="e", url=url, host="10.0.0.1", port=1, nccl_port=2, base_gpu_id=0, tp_size=1,
                          device="cuda", pid=7, healthy=True, restarts=restarts, worker_id=None)

    n1 = RolloutNode(cfg, rd, node=1, node_name="n1", host="10.0.0.2", attempt=0)
    n0 = RolloutNode(cfg, rd, node=0, node_name="n0", host="10.0.0.1", attempt=0)
    n1._publish([info("http://10.0.0.2:1", restarts=2)])
    assert Control(rd).engines() == []  # only node 0 writes engines.json
    n0._publish([info("http://10.0.0.1:1"), info("http://10.0.0.1:3")])
    urls = [e.url for e in Control(rd).engines()]
    assert urls == ["http://10.0.0.1:1", "http://10.0.0.1:3", "http://10.0.0.2:1"]
    assert n0.restarts_total() == 2 and n0.engine_urls() == urls
    assert [e.node for e in Control(rd).engines()] == ["n0", "n0", "n1"]


def test_nodes_after_the_first_look_for_the_end_when_node_zeros_router_goes_silent(tmp_path):
    """Nodes > 0 look for the run's end on their own only every END_POLL_S (2 minutes: each look is 6
    metadata operations on the shared run directory, docs/shared-fs-load.md); node 0 closes its router
    when the run ends, and the poll that finds it silent looks at once."""
    import asyncio
    import http.server
    import threading

    from rlslurm.rollout.main import SharedLook, until_end
    from rlslurm.rollout.node import RemoteRouter, RolloutNode

    class Router(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            body = b'{"workers": []}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    rd = _run_dir(tmp_path)
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Router)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    node = RolloutNode(RunConfig(), rd, node=1, node_name="n1", host="127.0.0.1", attempt=0)
    node.router = RemoteRouter.at(f"http://127.0.0.1:{srv.server_address[1]}", api_key=None,
                                  log_path=tmp_path / "router.log")
    looks = []
    look = SharedLook(rd, Control(rd), max_age_s=0)

    def counted():
        looks.append(1)
        return look()

    async def scenario():
        end = asyncio.ensure_future(until_end(None, node.housekeeping, counted, end_poll_s=3600))
        await asyncio.sleep(2.5)  # a live router: only the first look
        assert looks == [1] and not end.done()
        rd.mark_finished({"test": True})
        srv.shutdown()  # node 0 ended: its router goes
        srv.server_close()
        return await asyncio.wait_for(end, timeout=10)

    try:
        assert asyncio.run(scenario()) == "finished"
    finally:
        node.close()


def test_node_zeros_driver_shares_its_look_for_the_end(tmp_path, monkeypatch):
    """The driver's stop check (every 0.5 s) and node 0's end loop (every 1 s) answer from one look
    at most POLL_S old: one listing of the run directory and one of control/ a second, not three."""
    from rlslurm.rollout.main import SharedLook

    rd = _run_dir(tmp_path)
    control = Control(rd)
    listed = []
    real = Control.requests
    monkeypatch.setattr(Control, "requests", lambda self: listed.append(1) or real(self))
    look = SharedLook(rd, control, max_age_s=0.5)
    assert not any(look().driver_should_stop() for _ in range(20)) and look().end_reason() is None
    assert len(listed) == 1
    control.request_stop("test")
    time.sleep(0.5)
    assert look().driver_should_stop() and look().end_reason() is None  # a request; the ack is the trainer's
    control.ack_stop(checkpoint_iteration=0)
    time.sleep(0.5)
    assert look().end_reason() == "stop" and len(listed) == 3


def test_node_zero_answers_engines_from_memory_and_reads_the_version_only_when_it_decides(tmp_path, monkeypatch):
    """Node 0 writes engines.json: the driver's engine list (every 0.5 s while it waits for weights) comes
    from what it wrote, and the published version is read only while some engines have the version a
    rollout needs and others not (docs/shared-fs-load.md)."""
    import asyncio

    from rlslurm.engines.supervisor import EngineInfo
    from rlslurm.rollout.driver import RolloutDriver
    from rlslurm.rollout.node import RolloutNode

    rd = _run_dir(tmp_path)
    n0 = RolloutNode(RunConfig(), rd, node=0, node_name="n0", host="10.0.0.1", attempt=0)
    n0._publish([EngineInfo(name="e", url="http://10.0.0.1:1", host="10.0.0.1", port=1, nccl_port=2, base_gpu_id=0,
                            tp_size=1, device="cuda", pid=7, healthy=True, restarts=0, worker_id=None)])
    reads = []
    for name in ("engines", "weight_version"):
        real = getattr(Control, name)
        monkeypatch.setattr(Control, name, lambda self, *a, _r=real, _n=name: reads.append(_n) or _r(self, *a))
    assert n0.engine_urls() == ["http://10.0.0.1:1"] and n0.restarts_total() == 0 and reads == []

    from rlslurm.settings.runfile import load_run_config

    cfg = load_run_config(rd.path)
    driver = RolloutDriver(cfg, rd, router_url=None, engine_urls=n0.engine_urls, api_key=None, tokenizer=None,
                           source=object(), poll_s=0.01)  # the weight gate needs neither prompts nor tokens
    versions = {"a": 0, "b": 0}

    async def engine_versions():
        return dict(versions)

    driver.engine_versions = engine_versions
    rid = cfg.rollout.async_buffer_size + 1  # needs version 1

    async def scenario():
        wait = asyncio.ensure_future(driver.wait_for_weights(rid))
        await asyncio.sleep(0.2)  # ~20 polls, every engine behind: nothing to read
        assert not wait.done() and reads == []
        Control(rd).set_weight_version(1)
        versions["a"] = 1  # b was restarted and missed it: the published version decides
        return await asyncio.wait_for(wait, timeout=5)

    assert asyncio.run(scenario()) == 0 and "weight_version" in reads and "engines" not in reads
