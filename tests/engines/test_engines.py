"""Engines, router and supervisor: the CPU shim pieces on their own, then a real deployment
(two real SGLang servers on CPU behind the real sglang-router, see conftest.py).

Server tests run in file order on one shared deployment; the router restart test comes last.
Engine restarts are proved where they happen in a run: kill -9 mid-rollout (the supervisor reaps the
old tree and its /dev/shm files) in tests/rollout/test_driver.py, a hung engine held off during a
weight update and restarted after it in tests/weight_sync and tests/e2e/test_weight_sync_faults_slurm.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from rlslurm.engines import sglang_cpu
from rlslurm.engines.engine import ENV_API_KEY, EngineSpec
from rlslurm.engines.router import RouterProcess
from rlslurm.engines.sglang_client import SGLangClient, SGLangError
from rlslurm.errors import ConfigError
from rlslurm.net import allocate_ports, consecutive_ports, engine_port_block, free_port, node_ip
from tests.helpers.process_groups import pid_alive


def _spec(tmp_path, **kw) -> EngineSpec:
    base = dict(name="engine-0", model_path="/models/m", host="10.1.2.3", port=31000, nccl_port=31001,
                log_path=tmp_path / "e.log", api_key="sekret", dtype="float32", device="cpu")
    base.update(kw)
    return EngineSpec(**base)


# --- no servers --------------------------------------------------------------------------------
def test_spec_argv_has_every_flag_and_never_the_key(tmp_path):
    spec = _spec(tmp_path, base_gpu_id=2, tp_size=2, cpu_core=1,
                 extra_args=("--max-running-requests", "7", "--max-total-tokens=999"))
    argv = spec.argv()
    assert argv[:3] == ["taskset", "-c", "1"]
    assert all(isinstance(a, str) for a in argv)
    joined = " ".join(argv)
    for flag in ("--model-path /models/m", "--host 10.1.2.3", "--port 31000", "--nccl-port 31001",
                 "--base-gpu-id 2", "--tp-size 2", "--dtype float32", "--device cpu",
                 "--attention-backend torch_native", "--sampling-backend pytorch", "--sleep-on-idle",
                 "--max-running-requests 7"):
        assert flag in joined, flag
    # passthrough flags come last so that they override the CPU defaults (argparse: last wins)
    assert argv[-1] == "--max-total-tokens=999" and joined.index("--max-total-tokens 16384") < len(joined) - 30
    assert "sekret" not in joined
    env = spec.env({"PATH": "/bin", ENV_API_KEY: "stale"}, tmpdir="/tmp/x")
    assert env[ENV_API_KEY] == "sekret" and env["TMPDIR"] == "/tmp/x" and env["OMP_NUM_THREADS"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(sglang_cpu.STUBS_DIR)
    assert ENV_API_KEY not in _spec(tmp_path, api_key=None).env({ENV_API_KEY: "stale"})
    assert env["NO_PROXY"] == "10.1.2.3,127.0.0.1,localhost"
    assert spec.env({"no_proxy": ".corp,127.0.0.1"})["no_proxy"] == ".corp,127.0.0.1,10.1.2.3,localhost"
    assert _spec(tmp_path, host="::1").url == "http://[::1]:31000"


@pytest.mark.parametrize("kw, needle", [
    (dict(extra_args=("--port", "1")), "--sglang-port"),
    (dict(extra_args=("--api-key=x",)), "--sglang-api-key"),
    (dict(extra_args=("--tp-size", "4")), "--sglang-tp-size"),
    (dict(host="node017"), "node017"),
    (dict(host="0.0.0.0"), "wildcard"),
    (dict(nccl_port=31000), "must differ"),
    (dict(port=70000), "70000"),
    (dict(dtype="fp8"), "fp8"),
    (dict(extra_args=("--nnodes", "2")), "--sglang-nnodes"),
    (dict(extra_args=("--nccl-init-addr=1.2.3.4:5",)), "--sglang-nccl-init-addr"),
    (dict(nnodes=2, node_rank=2, tp_size=2), "node rank 2 of 2 nodes"),
    (dict(nnodes=2, tp_size=3), "tp_size 3"),
])
def test_spec_rejects_bad_input_naming_it(tmp_path, kw, needle):
    with pytest.raises(ConfigError, match=needle):
        _spec(tmp_path, **kw)


def test_router_rejects_owned_passthrough_and_hostname(tmp_path):
    with pytest.raises(ConfigError, match="--router-port"):
        RouterProcess(host="127.0.0.1", port=1, log_path=tmp_path / "r.log", extra_args=("--port", "2"))
    with pytest.raises(ConfigError, match="localhost"):
        RouterProcess(host="localhost", port=1, log_path=tmp_path / "r.log")


def test_cpu_path_is_pinned_to_the_known_sglang(monkeypatch):
    if sglang_cpu.installed_sglang_version() == sglang_cpu.SGLANG_VERSION:
        sglang_cpu.check_sglang_version()
    monkeypatch.setattr(sglang_cpu, "installed_sglang_version", lambda: "0.6.0")
    with pytest.raises(ConfigError, match=r"is 0\.6\.0.*sglang==0\.5\.23"):
        sglang_cpu.check_sglang_version()
    monkeypatch.setattr(sglang_cpu, "installed_sglang_version", lambda: None)
    with pytest.raises(ConfigError, match="not installed"):
        sglang_cpu.check_sglang_version()


def test_only_a_cpu_server_forks_its_children(monkeypatch):
    import multiprocessing

    assert sglang_cpu.is_cpu_launch(["--port", "1", *sglang_cpu.cpu_server_args()])
    assert not sglang_cpu.is_cpu_launch(["--device", "cuda"]) and not sglang_cpu.is_cpu_launch(["cpu", "--device"])
    asked: list[tuple] = []
    monkeypatch.setattr(multiprocessing, "set_start_method", lambda m=None, force=False: asked.append((m, force)))
    monkeypatch.setitem(sys.modules, "megatron", sys.modules.get("megatron"))  # put back as it was after the test
    monkeypatch.delitem(sys.modules, "megatron")
    sglang_cpu.fork_subprocesses()
    multiprocessing.set_start_method("spawn", force=True)  # what SGLang's launch code calls
    multiprocessing.set_start_method("forkserver")
    assert asked == [("fork", True), ("forkserver", False)]
    with pytest.raises(ImportError):  # SGLang's dumper finds no megatron-core in a CPU server
        import megatron.core  # noqa: F401


def test_port_block_is_distinct_and_bindable():
    block = engine_port_block("127.0.0.1", 4)
    ports = [p for e in block for p in (e.port, e.nccl_port)]
    assert len(set(ports)) == 8
    for p in ports:
        with socket.socket() as s:
            s.bind(("0.0.0.0", p))
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        assert taken not in allocate_ports("127.0.0.1", 50)
    assert 0 < free_port() < 65536
    # an engine spanning nodes: SGLang derives its inter-node ports from the dist-init one
    first = consecutive_ports("127.0.0.1", 8)
    held = [socket.socket() for _ in range(8)]
    try:
        for s, p in zip(held, range(first, first + 8)):
            s.bind(("0.0.0.0", p))
    finally:
        for s in held:
            s.close()


def test_node_ip_is_an_ip_literal(monkeypatch):
    monkeypatch.setenv("RLSLURM_NODE_IP", " 10.9.8.7 ")
    assert node_ip() == "10.9.8.7"
    monkeypatch.setenv("RLSLURM_NODE_IP", "gpu-node-1")
    with pytest.raises(ConfigError, match="RLSLURM_NODE_IP.*gpu-node-1"):
        node_ip()
    monkeypatch.delenv("RLSLURM_NODE_IP")
    monkeypatch.setenv("RLSLURM_ROUTE_PROBE", "127.0.0.1")
    assert node_ip() == "127.0.0.1"
    monkeypatch.delenv("RLSLURM_ROUTE_PROBE")
    import ipaddress
    ipaddress.ip_address(node_ip())


def test_rotary_stub_matches_transformers():
    """The pure-torch vllm rotary_embedding stub against HF's Qwen3 rotary (NeoX layout)."""
    import torch
    sys.path.insert(0, str(sglang_cpu.STUBS_DIR))
    try:
        from vllm._custom_ops import rotary_embedding
    finally:
        sys.path.remove(str(sglang_cpu.STUBS_DIR))
        sys.modules.pop("vllm", None)
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    torch.manual_seed(0)
    T, H, K, D, base = 7, 4, 2, 16, 10000.0
    inv_freq = 1.0 / base ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    freqs = torch.outer(torch.arange(64, dtype=torch.float32), inv_freq)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # SGLang's cos_sin_cache layout
    positions = torch.tensor([0, 3, 5, 9, 17, 40, 63])
    q, k = torch.randn(T, H * D), torch.randn(T, K * D)
    q_ref, k_ref = q.clone(), k.clone()
    rotary_embedding(positions, q, k, D, cache, True)
    emb = torch.cat((freqs, freqs), dim=-1)[positions]
    hq, hk = apply_rotary_pos_emb(q_ref.view(1, T, H, D).transpose(1, 2), k_ref.view(1, T, K, D).transpose(1, 2),
                                  emb.cos()[None], emb.sin()[None])
    torch.testing.assert_close(q.view(T, H, D), hq.transpose(1, 2)[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k.view(T, K, D), hk.transpose(1, 2)[0], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(q, q_ref)


def test_torchvision_stub_imports_but_refuses_to_run():
    code = ("import torchvision, torchvision.transforms as T\n"
            "from torchvision.transforms import InterpolationMode\n"
            "import torchvision.transforms.v2.functional as F\n"
            "mode = InterpolationMode.BICUBIC\n"
            "try:\n    T.Compose([])\nexcept RuntimeError as e:\n    print('refused:', e)\n")
    env = sglang_cpu.cpu_env({"PATH": os.environ.get("PATH", "")})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "refused:" in out.stdout and "not available on rlslurm's SGLang CPU path" in out.stdout


@pytest.mark.sglang
def test_bad_passthrough_flag_fails_start_with_the_flag_in_the_error(tmp_path, tiny_model):
    """A flag this node's SGLang refuses is the user's error (rlslurm/errors.py: final, no requeue),
    in one line naming the passthrough flag, not an engine crash."""
    from rlslurm.engines.engine import EngineProcess

    if sglang_cpu.installed_sglang_version() is None:
        pytest.skip("sglang is not installed")
    p = engine_port_block("127.0.0.1", 1)[0]
    e = EngineProcess(_spec(tmp_path, model_path=str(tiny_model), host="127.0.0.1", port=p.port,
                            nccl_port=p.nccl_port, extra_args=("--no-such-sglang-flag", "3")))
    e.start()
    try:
        with pytest.raises(ConfigError, match=r"^--sglang-\* passthrough: SGLang on \S+ refused it: "
                                              r"unrecognized arguments: --no-such-sglang-flag 3$"):
            e.wait_healthy(120)
    finally:
        e.kill_tree()
    assert not e.is_alive()


def test_health_check_ignores_a_proxy_from_the_environment(monkeypatch):
    import http.server
    import threading

    from rlslurm.engines.sglang_client import health_sync

    class Ok(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ok)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        assert health_sync(url, timeout=5)
        for var in ("HTTP_PROXY", "http_proxy", "ALL_PROXY"):
            monkeypatch.setenv(var, f"http://127.0.0.1:{free_port()}")  # a proxy that is not there
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        with pytest.raises(httpx.HTTPError):  # control: a client that trusts the env goes via the proxy
            httpx.get(url + "/health", timeout=5)
        assert health_sync(url, timeout=5)
    finally:
        srv.shutdown()


def test_client_errors_name_the_url():
    url = f"http://127.0.0.1:{free_port()}"

    async def go():
        async with SGLangClient(url, "k") as c:
            assert await c.health(timeout=1.0) is False
            with pytest.raises(SGLangError, match=f"{url}/generate: no response") as ei:
                await c.generate([1, 2], {"max_new_tokens": 1}, timeout=2.0)
            assert ei.value.status is None and ei.value.url == f"{url}/generate"

    asyncio.run(go())


def test_restart_budget_counts_tries_in_a_sliding_window():
    from rlslurm.engines.supervisor import RestartBudget

    b = RestartBudget(3, 100.0)
    assert [b.take(t) for t in (0.0, 10.0, 20.0, 30.0)] == [True, True, True, False]
    assert b.take(100.0) and not b.take(105.0)  # the try at 0 left the window, the one at 100 took its place
    assert b.take(110.0)  # 10 left too


def test_a_restarted_engine_awaiting_weights_counts_as_recovering(tmp_path):
    """Up again but not routed until the trainer publishes to it: the driver's generate retries must
    wait for it (rollout/router_context.py), as during the restart itself."""
    from rlslurm.engines.supervisor import EngineSupervisor
    from rlslurm.rollout.node import RemoteRouter

    spec = _spec(tmp_path, host="127.0.0.1", port=free_port("127.0.0.1"), nccl_port=free_port("127.0.0.1"),
                 model_path=str(tmp_path / "model"))
    router = RemoteRouter.at(f"http://127.0.0.1:{free_port('127.0.0.1')}", api_key=None, log_path=tmp_path / "r.log")
    sup = EngineSupervisor([spec], router)
    try:
        assert not sup.recovering()
        for state in ("restarting", "awaiting_weights"):
            with sup._cond:
                setattr(sup._slots[0], state, True)
            assert sup.recovering(), state
            with sup._cond:
                setattr(sup._slots[0], state, False)
        assert not sup.recovering()
    finally:
        sup.close()


def test_an_engine_that_never_comes_back_ends_the_attempt_after_its_restart_budget(tmp_path):
    """A restart that keeps failing (here: a start that exits at once - taskset refuses a core this
    host does not have) used to be retried every backoff for as long as the job ran."""
    from rlslurm.engines.supervisor import EngineFailure, EngineSupervisor
    from rlslurm.rollout.node import RemoteRouter

    port = free_port("127.0.0.1")
    spec = _spec(tmp_path, host="127.0.0.1", port=port, nccl_port=free_port("127.0.0.1"),
                 model_path=str(tmp_path / "model"), cpu_core=(os.cpu_count() or 1) + 4096)
    # nothing listens there: deregistering before each try fails fast and is only logged
    router = RemoteRouter.at(f"http://127.0.0.1:{free_port('127.0.0.1')}", api_key=None, log_path=tmp_path / "r.log")
    events = []
    sup = EngineSupervisor([spec], router, restart_backoff_s=0.0, max_restarts=3, restart_window_s=3600.0,
                           on_restart=events.append)
    try:
        sup.raise_if_failed()  # nothing wrong yet
        sup._tick()  # the health round: the engine's process is gone, so its restart thread starts
        for t in list(sup._restart_threads):
            t.join(timeout=120)  # three tries, each a start that exits at once
        assert not any(t.is_alive() for t in sup._restart_threads), "still retrying"
        with pytest.raises(EngineFailure) as ei:
            sup.raise_if_failed()
        msg = str(ei.value)
        assert msg.startswith(f"engine-0 (http://127.0.0.1:{port}): 3 restarts within 60 min (exited (code None); "
                              "the last try failed: engine-0 (") and "\n" not in msg, msg
        assert msg.endswith("not restarted again, this attempt ends")
        assert spec.log_path.read_text().count("==== rlslurm: start #") == 3  # exactly the budget
        assert [e.ok for e in events] == [False, False, False, False] and events[-1].error == msg
        sup._tick()  # given up: no fourth try
        assert not any(t.is_alive() for t in sup._restart_threads)
        assert spec.log_path.read_text().count("==== rlslurm: start #") == 3
    finally:
        sup.close()


def test_an_engine_process_gone_is_seen_between_health_rounds(tmp_path):
    """--colocate holds a restart only if the death is seen inside the trainer's turn (seconds long):
    before, a death waited for the next health round (every --engine-health-interval-s, plus the
    rounds' own checks), and a kill inside a short turn was restarted after it without the hold (the
    chaos soak's colocated run, tests/e2e/test_colocate_restart.py once in three). Here the engine's
    process (a real one, `sleep`) dies with health rounds a minute apart: its restart begins at once."""
    import threading

    from rlslurm.engines.supervisor import EngineSupervisor
    from rlslurm.rollout.node import RemoteRouter

    port = free_port("127.0.0.1")
    spec = _spec(tmp_path, host="127.0.0.1", port=port, nccl_port=free_port("127.0.0.1"),
                 model_path=str(tmp_path / "model"), cpu_core=(os.cpu_count() or 1) + 4096)
    router = RemoteRouter.at(f"http://127.0.0.1:{free_port('127.0.0.1')}", api_key=None, log_path=tmp_path / "r.log")
    events, held = [], []
    sup = EngineSupervisor([spec], router, health_interval_s=60.0, restart_backoff_s=0.0, max_restarts=1,
                           on_restart=events.append, hold_restart=lambda: held.append(1) or None)
    [slot] = sup._slots
    slot.proc.proc = subprocess.Popen(["sleep", "600"], start_new_session=True)  # the running incarnation
    loop = threading.Thread(target=sup._loop, daemon=True)
    loop.start()
    try:
        time.sleep(0.5)
        assert not events and not held  # alive: nothing happens between rounds
        slot.proc.proc.kill()
        deadline = time.monotonic() + 20  # the next health round would be 60 s away
        while not events and time.monotonic() < deadline:
            time.sleep(0.1)
        assert events and held, (events, held)  # the restart asked the turn, then tried (and failed: no core)
        assert events[0].reason.startswith("exited (code -9)"), events[0]
    finally:
        sup.close()
        if slot.proc.proc is not None and slot.proc.proc.poll() is None:
            slot.proc.proc.kill()


# --- a real deployment -----------------------------------------------------------------------


def _post(url: str, path: str, key: str | None, body: dict, timeout: float = 60.0) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + path, json=body, headers=headers, timeout=timeout)


@pytest.mark.sglang
@pytest.mark.slow
def test_engines_healthy_registered_and_published(deployment, tmp_path):
    from rlslurm.buffer.control import Control
    from rlslurm.buffer.rundir import RunDir
    from rlslurm.engines.procfs import descendants
    from rlslurm.engines.supervisor import control_publisher

    sup, router = deployment.supervisor, deployment.router
    infos = sup.engines()
    assert [i.healthy for i in infos] == [True, True] and [i.restarts for i in infos] == [0, 0]
    assert deployment.changes and deployment.changes[-1] == infos
    workers = {w["url"]: w for w in router.workers()}
    for i in infos:
        w = workers[i.url]
        assert w["is_healthy"] and w["id"] == i.worker_id
        # the router fetched the keyed /model_info: proof that "api_key" reached it in POST /workers
        assert w["model_id"] != "unknown", w
    for i in infos:  # the KV pool is the fixed --max-total-tokens, whatever the node's free memory
        info = httpx.get(i.url + "/server_info", headers={"Authorization": f"Bearer {deployment.api_key}"},
                         timeout=30).json()
        states = info.get("internal_states") or [{}]
        assert info.get("max_total_tokens") == 8192, {k: v for k, v in info.items() if "token" in k}
        assert states[0].get("max_total_num_tokens", 8192) == 8192, states[0]
    for i in infos:  # scheduler and detokenizer forked, not spawned (sglang_cpu.fork_subprocesses)
        kids = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in descendants(i.pid)]
        assert kids and not [k for k in kids if b"multiprocessing.spawn" in k], kids
    control = Control(RunDir.create(tmp_path / "run"))
    control_publisher(control, node="node0")(infos)
    recs = control.engines()
    assert [r.url for r in recs] == [i.url for i in infos]
    assert all(r.healthy and r.node == "node0" and r.pid == i.pid and r.gpu_ids == [] for r, i in zip(recs, infos))


@pytest.mark.sglang
@pytest.mark.slow
def test_requests_without_the_job_key_are_rejected(deployment):
    key, router = deployment.api_key, deployment.router
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}
    for url in [*deployment.supervisor.urls, router.url]:
        assert _post(url, "/generate", None, body).status_code == 401, url
        assert _post(url, "/generate", key + "x", body).status_code == 401, url
        assert _post(url, "/generate", key, body).status_code == 200, url
    assert httpx.get(router.url + "/workers", timeout=10).status_code == 401
    for url in deployment.supervisor.urls:
        assert httpx.post(url + "/flush_cache", timeout=10).status_code == 401
        assert httpx.get(url + "/health", timeout=10).status_code == 200  # SGLang leaves /health open
    for slot in deployment.supervisor._slots:
        for pid in slot.proc.tree_pids():
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert key.encode() not in f.read(), f"api key visible in argv of pid {pid}"


@pytest.mark.sglang
@pytest.mark.slow
def test_logs_never_hold_the_key_and_are_private(deployment):
    """Real SGLang 0.5.23 logs `server_args={..., 'api_key': '<key>', ...}` at start; the launcher's
    filter masks it (engines/log_scrub.py) and the logs are 0600 whatever the umask."""
    logs = sorted(deployment.log_dir.glob("*.log"))
    assert {p.name for p in logs} >= {"engine-0.log", "engine-1.log", "router.log"}
    for p in logs:
        text = p.read_text(errors="replace")
        assert deployment.api_key not in text, f"api key in {p}"
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
        if p.name.startswith("engine-"):  # the line is there, masked: the filter ran, SGLang still prints it
            assert "'api_key': '***'" in text, text[-2000:]


def _prompts(n: int) -> list[list[int]]:
    return [[1] + [4 + (7 * i + 3 * j) % 60 for j in range(5 + i % 4)] for i in range(n)]


@pytest.mark.sglang
@pytest.mark.slow
def test_logprobs_match_teacher_forced_recompute(deployment):
    """fp32: sampled-token logprobs == the same server's prompt logprobs for prompt+response
    (< 1e-4), and == HF transformers on the same checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(deployment.model_path, dtype=torch.float32).eval()
    key, new = deployment.api_key, 12
    vocab = hf.config.vocab_size

    async def check(url: str) -> float:
        worst = 0.0
        async with SGLangClient(url, key) as c:
            prompts = _prompts(6)
            outs = await asyncio.gather(*[
                c.generate(p, {"max_new_tokens": new, "temperature": 1.0, "ignore_eos": True}) for p in prompts])
            for p, o in zip(prompts, outs):
                resp = [t for _, t, _ in o["meta_info"]["output_token_logprobs"]]
                lps = [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
                assert resp == o["output_ids"] and len(resp) == new
                tf = await c.generate(p + resp, {"max_new_tokens": 0}, logprob_start_len=len(p) - 1)
                entries = tf["meta_info"]["input_token_logprobs"]
                # SGLang 0.5.23 reports the LAST vocab id as 0 in input_token_logprobs (it clips ids
                # >= vocab_size - 1, meant for image-pad hashes: logprob_result_processor.py:54);
                # the logprob value is still that of the real token.
                shown = [t if t < vocab - 1 else 0 for t in resp]
                assert entries[0][0] is None and [t for _, t, _ in entries[1:]] == shown
                recomputed = [lp for lp, _, _ in entries[1:]]
                with torch.no_grad():
                    logits = hf(torch.tensor([p + resp])).logits[0].float()
                ref = torch.log_softmax(logits, -1)[torch.arange(len(p) - 1, len(p) + new - 1), torch.tensor(resp)]
                d_tf = max(abs(a - b) for a, b in zip(lps, recomputed))
                d_hf = (torch.tensor(lps) - ref).abs().max().item()
                assert d_tf < 1e-4 and d_hf < 1e-4, (url, d_tf, d_hf)
                worst = max(worst, d_tf, d_hf)
        return worst

    for url in [*deployment.supervisor.urls, deployment.router.url]:
        asyncio.run(check(url))


async def _rollout(url: str, key: str, n: int, new: int | list[int], done: list) -> list:
    lengths = new if isinstance(new, list) else [new] * n
    async with SGLangClient(url, key) as c:
        async def one(p, m):
            out = await c.generate(p, {"max_new_tokens": m, "temperature": 1.0, "ignore_eos": True}, timeout=300)
            done.append(time.monotonic())
            return out
        return await asyncio.gather(*[one(p, m) for p, m in zip(_prompts(n), lengths)], return_exceptions=True)


def _ok_restarts(deployment, what: str = "engine") -> list:
    return [e for e in deployment.restarts if e.ok and (e.engine == "router") == (what == "router")]


def _wait_restart(deployment, count: int, timeout: float = 240.0, what: str = "engine"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ok = _ok_restarts(deployment, what)
        if len(ok) >= count:
            return ok[count - 1]
        time.sleep(0.5)
    raise AssertionError(f"no restart #{count} within {timeout} s: {deployment.restarts}")


@pytest.mark.sglang
@pytest.mark.slow
def test_dead_router_is_restarted_and_workers_registered_again(deployment):
    sup, router, key = deployment.supervisor, deployment.router, deployment.api_key
    old_pid = router.proc.pid
    os.kill(old_pid, signal.SIGKILL)
    ev = _wait_restart(deployment, 1, timeout=90, what="router")
    assert ev.ok and sup.router_restarts == 1 and router.proc.pid != old_pid and not pid_alive(old_pid)
    workers = {w["url"]: w for w in router.workers()}
    for i in sup.engines():
        assert workers[i.url]["is_healthy"] and workers[i.url]["id"] == i.worker_id
        assert workers[i.url]["model_id"] != "unknown"
    outs = asyncio.run(_rollout(router.url, key, 4, 4, []))
    assert all(not isinstance(o, BaseException) for o in outs), outs
    assert _post(router.url, "/generate", None, {"input_ids": [5], "sampling_params": {}}).status_code == 401
