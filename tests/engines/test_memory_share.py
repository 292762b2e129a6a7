"""The colocated engines' memory share (rlslurm/engines/memory_share.py) and an engine's death that no
restart can help (engines/engine.py `raise_if_final`, the supervisor's `final`).

On this CPU machine there is no GPU to size: the share's arithmetic is checked with the figures the GPU
machines reported (an H200: 140.4 GiB, SGLang 0.5.14's default share 0.907 there, 0.835 on an 80 GB
H100), and the path from the rollout node's plan to the engine process's refusal runs for real (a real
`python -m rlslurm.engines.engine` process, which cannot read a GPU here and says so in one line). The
GPU tier runs the derived share on a GPU (tests/gpu/test_gpu_grpo.py, test_colocate_families.py).
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from rlslurm.engines import memory_share
from rlslurm.engines.engine import EngineOutOfMemory, EngineSetupError, EngineSpec
from rlslurm.engines.memory_share import GIB, EngineMemoryError, MemoryPlan, derive, trainer_margin
from rlslurm.net import free_port

H200, H100 = int(140.4 * GIB), int(79.2 * GIB)


def test_the_share_leaves_sglang_its_reserve_and_the_trainer_its_margin() -> None:
    """What the engine gets (share x free) plus SGLang's reserve and the trainer's margin is the free
    memory, whatever the GPU; the share is below SGLang's own default (which assumed the GPU alone)."""
    for total, default in ((H200, 0.907), (H100, 0.835)):
        margin = trainer_margin(2 * 2**20, 512 * 2**20, total)  # the demo's params, one bucket
        free = total - int(1.2 * GIB)  # the trainer's context and what it keeps off-loaded
        f = derive(total=total, free=free, sglang_default=default, margin=margin, weights=2 * 2**20)
        reserve = (1 - default) * total
        assert f < default
        assert f * free + reserve + margin <= free < (f + 0.001) * free + reserve + margin
    # the trainer keeps 40 GiB of state on an H100 (--no-offload-train): the engines shrink to fit beside it
    big = derive(total=H100, free=H100 - 40 * GIB, sglang_default=0.835, margin=trainer_margin(8 * GIB, 2**29, H100),
                 weights=8 * GIB)
    assert 0.3 < big < 0.5


def test_a_model_that_cannot_fit_beside_the_trainer_is_one_line() -> None:
    with pytest.raises(EngineMemoryError, match=r"does not fit colocated on this GPU") as e:
        derive(total=H100, free=20 * GIB, sglang_default=0.835, margin=trainer_margin(8 * GIB, 2**29, H100),
               weights=8 * GIB)
    assert "\n" not in str(e.value) and "--rollout-num-gpus-per-engine" in str(e.value)


def _sized(monkeypatch, tmp_path, args: list[str]):
    # the GPU (nvidia-smi) and SGLang's default share (its server_args on a GPU) as the H200 reported them
    monkeypatch.setattr(memory_share, "gpu_memory", lambda devices: (H200, H200 - GIB))
    monkeypatch.setattr(memory_share, "sglang_default_share", lambda a: 0.907)
    return memory_share.size_engine(args, trainer_margin(2**20, 2**29, H200), 2**20, tmp_path / "engine-0.memory.jsonl")


def test_the_engine_gets_the_derived_share_and_it_is_recorded(monkeypatch, tmp_path) -> None:
    args, share = _sized(monkeypatch, tmp_path, ["--model-path", "m", "--base-gpu-id", "0", "--tp-size", "1"])
    assert args[-2:] == ["--mem-fraction-static", f"{share.fraction:.3f}"] and share.derived
    [rec] = [json.loads(line) for line in (tmp_path / "engine-0.memory.jsonl").read_text().splitlines()]
    assert rec["fraction"] == share.fraction and rec["sglang_default"] == 0.907 and rec["derived"]
    _sized(monkeypatch, tmp_path, ["--model-path", "m"])  # the engine's restart: a second line
    assert len((tmp_path / "engine-0.memory.jsonl").read_text().splitlines()) == 2
    assert "derived by rlslurm" in share.describe() and not share.risky


def test_a_share_the_user_gave_stands_and_a_risky_one_is_said(monkeypatch, tmp_path) -> None:
    args, share = _sized(monkeypatch, tmp_path, ["--model-path", "m", "--mem-fraction-static", "0.95"])
    assert args.count("--mem-fraction-static") == 1 and share.fraction == 0.95 and not share.derived
    assert share.risky and "given by the user (rlslurm would derive 0.8" in share.describe()
    _, modest = _sized(monkeypatch, tmp_path, ["--model-path", "m", "--mem-fraction-static", "0.5"])
    assert not modest.risky


def test_an_engine_that_cannot_size_its_share_is_refused_in_one_line(tmp_path) -> None:
    """The rollout node's plan reaches the engine's process (EngineSpec.env); that process waits for the
    trainer's record of its attempt (an earlier attempt's does not count), then cannot read a GPU on this
    machine, refuses before SGLang starts, and the rollout node gets one line, a user error: no restart or
    requeue would help."""
    import threading

    from rlslurm.buffer.control import ColocationMemory, Control

    control = Control(tmp_path / "run")
    control.write_colocation_memory(ColocationMemory(attempt=0, margins={"": GIB}))  # the previous attempt's
    spec = EngineSpec(name="engine-0-0", model_path=str(tmp_path / "model"), host="127.0.0.1",
                      port=free_port("127.0.0.1"), nccl_port=free_port("127.0.0.1"), log_path=tmp_path / "e.log",
                      device="cuda", memory=MemoryPlan(record=str(control.colocation_memory_file), attempt=1,
                                                       weights_bytes=GIB))
    env = spec.env()
    assert MemoryPlan.from_env(env[memory_share.ENV]) == spec.memory
    from rlslurm.engines.engine import EngineProcess

    proc = EngineProcess(spec)
    log = spec.log_path
    log.write_text(f"==== rlslurm: start #1 of {spec.name} at {time.ctime()}: ...\n")
    with open(log, "ab") as out:
        proc.proc = subprocess.Popen(spec.argv(), env={**env, "PATH": "/nonexistent"}, stdout=out,
                                     stderr=subprocess.STDOUT, start_new_session=True)
    later = threading.Timer(8.0, lambda: control.write_colocation_memory(ColocationMemory(attempt=1,
                                                                                         margins={"": GIB})))
    later.start()
    t0 = time.monotonic()
    with pytest.raises(EngineSetupError, match=r"engine-0-0: --colocate: the GPUs' free memory cannot be read") as e:
        proc.wait_healthy(120)
    assert time.monotonic() - t0 >= 8.0  # it waited for this attempt's trainer
    assert proc.proc.returncode == 3 and "\n" not in str(e.value)
    assert "waiting for the trainer to build its model" in log.read_text()


# What an engine's death by CUDA OOM leaves in its log: the lines of the H200 run the issue quotes
# (torch_memory_saver's resume, then torch's allocator), around an invented traceback.
OOM_LOG = """\
[2026-12-05 10:01:02] Scheduler hit an exception: Traceback (most recent call last):
  File "sglang/srt/managers/scheduler.py", line 2794, in run_scheduler_process
RuntimeError: torch_memory_saver resume: out of memory (cudaErrorMemoryAllocation)
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.86 GiB. \
GPU 0 has a total capacity of 139.81 GiB of which 956.00 MiB is free.
"""


def _supervised_sleeper(tmp_path, log_text: str):
    """A supervisor over one engine whose running incarnation is a real process (`sleep`) with `log_text`
    in its log; a restart would fail (taskset refuses a core this host lacks) and be counted."""
    import os

    from rlslurm.engines.supervisor import EngineSupervisor
    from rlslurm.rollout.node import RemoteRouter

    spec = EngineSpec(name="engine-0-0", model_path=str(tmp_path / "model"), host="127.0.0.1",
                      port=free_port("127.0.0.1"), nccl_port=free_port("127.0.0.1"), log_path=tmp_path / "e.log",
                      device="cpu", cpu_core=(os.cpu_count() or 1) + 4096)
    spec.log_path.write_text(f"==== rlslurm: start #1 of {spec.name} at {time.ctime()}: ...\n"
                             "rlslurm engine memory: waiting for the trainer to build its model and leave the GPUs\n"
                             "rlslurm engine memory: the trainer keeps params, grads, optimizer state resident\n"
                             "rlslurm engine memory (info): --mem-fraction-static 0.881 derived by rlslurm: ...\n"
                             + log_text)
    router = RemoteRouter.at(f"http://127.0.0.1:{free_port('127.0.0.1')}", api_key=None, log_path=tmp_path / "r.log")
    events: list = []
    sup = EngineSupervisor([spec], router, restart_backoff_s=0.0, max_restarts=2, on_restart=events.append)
    sup._slots[0].proc.proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
    return sup, events


def test_an_engine_dead_of_cuda_oom_is_reported_once_and_not_restarted(tmp_path) -> None:
    """Before: an OOM death was restarted like any other (on the H200, every resume after a turn: the
    same share OOMed again, ~35 s a restart) until the budget ran out, then the job requeued."""
    sup, events = _supervised_sleeper(tmp_path, OOM_LOG)
    try:
        sup._slots[0].proc.proc.kill()
        sup._slots[0].proc.proc.wait()
        sup._tick()
        for t in list(sup._restart_threads):
            t.join(timeout=60)
        with pytest.raises(EngineOutOfMemory) as e:
            sup.raise_if_failed()
        msg = str(e.value)
        assert "\n" not in msg and "engine-0-0 ran out of GPU memory while serving" in msg
        assert "Tried to allocate 3.86 GiB" in msg and "--sglang-mem-fraction-static" in msg
        assert "0.881 derived by rlslurm" in msg  # the share it had, to go below
        assert sup._slots[0].proc.spec.log_path.read_text().count("==== rlslurm: start #") == 1  # no restart
        assert [e.ok for e in events] == [False]
    finally:
        sup.close()


def test_other_deaths_are_still_restarted(tmp_path) -> None:
    sup, events = _supervised_sleeper(tmp_path, "RuntimeError: something else went wrong\n")
    try:
        sup._slots[0].proc.proc.kill()
        sup._slots[0].proc.proc.wait()
        sup._tick()
        for t in list(sup._restart_threads):
            t.join(timeout=120)
        assert sup._slots[0].proc.spec.log_path.read_text().count("==== rlslurm: start #") == 3  # two tries
        assert sup.final is None and sup.failure is not None
    finally:
        sup.close()


@pytest.mark.parametrize("value", ["1.5", "0", "-0.2", "most"])
def test_a_share_no_gpu_could_take_is_refused_at_submit(value: str, tmp_path) -> None:
    from tests.helpers.config_errors import one_line_naming
    from tests.helpers.prompt_files import prompt_lines

    (tmp_path / "p.jsonl").write_text(prompt_lines())
    one_line_naming(["--model", "tiny-qwen3", "--prompt-data", str(tmp_path / "p.jsonl"), "--nodes", "1",
                     "--sglang-mem-fraction-static", value], f"--sglang-mem-fraction-static {value}", "between 0 and 1")


def test_a_share_that_would_hold_too_many_tokens_gets_a_kv_pool_bound(monkeypatch, tmp_path) -> None:
    """SGLang's token allocator keeps 8 bytes per token of the KV pool outside the share: tiny-deepseek-v3
    (128 bytes of KV a token) colocated on one H100 got a pool of 521 M tokens, and its engine died at its
    first free, allocating 3.88 GiB (bench/results/gpu-lease-2026-12-07b.md, the figures used here: 77.4 GiB
    free of 79.6, SGLang's default 0.835, the trainer's margin 1.5 GiB). rlslurm bounds the pool where the
    share would hold more than MAX_POOL_TOKENS; a real model's share, or the user's own bound, stays."""
    from rlslurm.settings.model_config import load_model_config
    from rlslurm.trainer.offload_choice import kv_bytes_per_token

    monkeypatch.setattr(memory_share, "gpu_memory", lambda devices: (int(79.6 * GIB), int(77.4 * GIB)))
    monkeypatch.setattr(memory_share, "sglang_default_share", lambda a: 0.835)

    def sized(model: str, args: list[str]):
        kv = kv_bytes_per_token(load_model_config(model).arch, 1, 2)
        return memory_share.size_engine(["--model-path", "m", *args], int(1.5 * GIB), 2**20, None, kv)

    args, share = sized("tiny-deepseek-v3", [])
    assert args[-2:] == ["--max-total-tokens", str(memory_share.MAX_POOL_TOKENS)]
    assert share.pool_tokens > 500_000_000 and share.max_total_tokens == memory_share.MAX_POOL_TOKENS
    assert "--max-total-tokens 16777216 given by rlslurm" in share.describe()
    args, share = sized("qwen3-1.7B", [])  # 112 KiB a token: about 0.5 M tokens, SGLang's own sizing
    assert "--max-total-tokens" not in args and share.max_total_tokens is None and share.pool_tokens < 10**6
    args, share = sized("tiny-deepseek-v3", ["--max-total-tokens", "4096"])
    assert args.count("--max-total-tokens") == 1 and share.max_total_tokens is None
    # unknown KV bytes (a plan from before the field): nothing added
    assert "--max-total-tokens" not in memory_share.size_engine(["--model-path", "m"], GIB, 2**20, None)[0]


def test_the_rollout_node_tells_each_engine_its_kv_bytes_per_token() -> None:
    """The plan travels as JSON in the engine's environment; one written without the field still reads."""
    plan = MemoryPlan(record="r", attempt=1, weights_bytes=2, kv_bytes_per_token=128)
    assert MemoryPlan.from_env(plan.to_env()) == plan
    assert MemoryPlan.from_env('{"record": "r", "attempt": 1, "weights_bytes": 2}').kv_bytes_per_token == 0


def test_the_kv_bytes_per_token_follow_the_served_model_tp_and_kv_dtype() -> None:
    from rlslurm.engines.memory_share import serving_kv_bytes_per_token
    from rlslurm.settings.config import RunConfig
    from rlslurm.settings.model_config import load_model_config

    def cfg(model: str, *sglang: str) -> RunConfig:
        return RunConfig.model_validate({"model": {"model": model}, "run": {"colocate": True},
                                         "sglang_args": list(sglang)})

    def kv(model: str, tp: int, *sglang: str) -> int:
        return serving_kv_bytes_per_token(cfg(model, *sglang), load_model_config(model), tp)

    assert kv("tiny-deepseek-v3", 1) == 128  # MLA: (latent + rotary key) x layers x 2
    # qwen3-4B: 36 layers x K and V x 8 KV heads over TP 2 x 128 x 1 byte (fp8)
    assert kv("qwen3-4B", 2, "--kv-cache-dtype", "fp8_e5m2") == 36 * 2 * 4 * 128
