"""On a GPU machine with the bundle staged (docs/gpu.md): serve each tiny model config with the GPU
stack's SGLang as `rlslurm run --colocate --device cuda` starts its engine, and update its weights twice
through rlslurm's receiver by CUDA IPC, as the colocated trainer does (trainer/weights/ipc.py).

For each model: its checkpoint as the demo writes it (rlslurm.tiny, fp32; the engine runs bf16), an
engine with the bundle's flags plus `--enable-memory-saver --custom-weight-loader <receiver>
--weight-version 0 --skip-server-warmup`, then the colocated turn around each update (pause, release
all, resume weights, update, resume KV cache and CUDA graphs, continue):

  gen0   greedy tokens and log-probs from the checkpoint's weights
  sync 1 another seed's weights (the receiver learns its copy map from SGLang's load_weights)
  gen1   must differ from gen0
  sync 2 the checkpoint's weights again (the receiver replays what it learnt)
  gen2   must equal gen0: every tensor reached the engine, derived state included

One JSON line per model in OUT/families.jsonl, each engine's log in OUT/<model>.log:

    . tools/gpu/env.sh && python3 tools/gpu/family_engines.py OUT [--jobs 4] [MODEL ...]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.gpu.bundle_flags import BUNDLE_FLAGS  # noqa: E402

PROMPTS = [[1, 30, 31, 32, 5, 6, 7], [1, 40, 9, 12, 20]]
NEW_TOKENS = 8
ENGINES: set[int] = set()  # process groups of the engines running now


def _stop(signum, frame) -> None:
    """Killed (the device call's `timeout`): take the engines down too, then exit."""
    for pgid in list(ENGINES):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os._exit(128 + signum)


def _port() -> int:
    """A free port below 40000: SGLang 0.5.14 puts its gRPC port 10000 or more above --port and refuses
    one past 65535."""
    import random

    while True:
        port = random.randrange(20000, 40000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue


def _post(url: str, path: str, body: dict | None = None, timeout: float = 180) -> object:
    req = urllib.request.Request(url + path, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        text = r.read().decode()
    return json.loads(text) if text.strip().startswith(("{", "[")) else text


def _up(url: str, proc: subprocess.Popen, limit: float) -> None:
    end = time.time() + limit
    while time.time() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited with {proc.returncode} before it answered")
        try:
            with urllib.request.urlopen(url + "/model_info", timeout=5):
                return
        except (urllib.error.URLError, OSError):
            time.sleep(1)
    raise RuntimeError(f"engine not up after {limit:.0f} s")


def _generate(url: str) -> list[dict]:
    out = _post(url, "/generate", {"input_ids": PROMPTS, "return_logprob": True,
                                   "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS,
                                                       "ignore_eos": True}})
    return [{"ids": o["output_ids"], "lp": [t[0] for t in o["meta_info"]["output_token_logprobs"]]} for o in out]


def _same(a: list[dict], b: list[dict]) -> tuple[bool, float]:
    dl = max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra["lp"], rb["lp"]))
    return all(ra["ids"] == rb["ids"] for ra, rb in zip(a, b)), dl


def _weights(mc, ckpt: Path):
    """The checkpoint's tensors that the trainer sends (the mapping's names), bf16 on the GPU, as the
    trainer's export casts them (convert/export.py)."""
    import torch
    from safetensors.torch import load_file

    from rlslurm.convert.mapping import expected_hf_names

    tensors = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        tensors.update(load_file(f))
    return [(n, tensors[n].to(device="cuda", dtype=torch.bfloat16).contiguous()) for n in expected_hf_names(mc)]


def _sync(url: str, bucket) -> float:
    """One update of every tensor in one bucket, read in place by the receiver (trainer/weights/ipc.py)."""
    import torch

    from rlslurm.engines.receiver import LOADER, mapped_payload
    from rlslurm.engines.shared_buffer import cuda_source
    from rlslurm.trainer.weights.buckets import bucket_plan, serialized_plan

    buf = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in bucket])
    src = cuda_source(buf)
    entry = serialized_plan(mapped_payload([bucket_plan(bucket)], [src]))
    t0 = time.time()
    _post(url, "/pause_generation", {"mode": "abort"})
    _post(url, "/release_memory_occupation", {})
    _post(url, "/resume_memory_occupation", {"tags": ["weights"]})
    r = _post(url, "/update_weights_from_tensor", {"serialized_named_tensors": [entry], "load_format": LOADER,
                                                   "flush_cache": True}, timeout=60)
    if not (isinstance(r, dict) and r.get("success")):
        raise RuntimeError(f"update_weights_from_tensor: {r}")
    _post(url, "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})
    _post(url, "/continue_generation", {})
    torch.cuda.synchronize()
    del buf
    return time.time() - t0


def _stem(name: str) -> str:
    """A shipped config's name, or a config file's (a variant under test) stem."""
    return Path(name).stem if name.endswith((".yaml", ".yml")) else name


def checkpoints(name: str, out: Path) -> tuple[Path, Path]:
    """The demo's checkpoint of `name` and another seed's (one at a time: the seed is global), in bf16:
    what the trainer sends, so that sending the checkpoint's own weights back restores it exactly (an
    fp32 file would leave the engine's fp32 parameters, the router correction bias, at fp32 values)."""
    from rlslurm.settings.model_config import load_model_config
    from rlslurm.tiny import make_tiny_checkpoint

    mc, stem = load_model_config(name), _stem(name)
    return (make_tiny_checkpoint(mc, out / "ckpt" / stem, dtype="bfloat16"),
            make_tiny_checkpoint(mc, out / "ckpt" / f"{stem}-1", seed=1, dtype="bfloat16"))


def probe(name: str, out: Path) -> dict:
    from rlslurm.settings.model_config import load_model_config

    stem = _stem(name)
    res: dict = {"model": stem}
    mc = load_model_config(name)
    ckpt, other = out / "ckpt" / stem, out / "ckpt" / f"{stem}-1"
    port = _port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(ckpt), "--host", "127.0.0.1",
           "--port", str(port), "--nccl-port", str(_port()), "--tp-size", "1", "--dtype", "bfloat16",
           "--device", "cuda", "--skip-server-warmup", *BUNDLE_FLAGS, "--enable-memory-saver",
           "--custom-weight-loader", "rlslurm.engines.receiver.receive", "--weight-version", "0",
           "--max-total-tokens", "4096", "--mem-fraction-static", "0.15"]
    if json.loads((ckpt / "config.json").read_text()).get("auto_map"):
        cmd.append("--trust-remote-code")  # its config class is remote code (MiMo)
    res["flags"] = cmd[cmd.index("--skip-server-warmup"):]
    log = out / f"{stem}.log"
    t0 = time.time()
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    ENGINES.add(proc.pid)
    try:
        _up(url, proc, 240)
        res["up_s"] = round(time.time() - t0, 1)
        gen0 = _generate(url)
        res["gen0"] = gen0[0]["ids"]
        res["sync1_s"] = round(_sync(url, _weights(mc, other)), 2)
        res["changed"] = not _same(gen0, _generate(url))[0]
        res["sync2_s"] = round(_sync(url, _weights(mc, ckpt)), 2)
        same, dl = _same(gen0, _generate(url))
        res["restored"], res["restored_max_dlogprob"] = same and dl < 1e-3, dl
        res["ok"] = res["changed"] and res["restored"]
    except Exception as e:  # the engine's own words are in its log
        res["ok"], res["error"] = False, f"{type(e).__name__}: {e}"
    finally:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        proc.wait()
        ENGINES.discard(proc.pid)
    text = log.read_text(errors="replace").splitlines()
    res["receiver"] = [ln for ln in text if "rlslurm receiver: bucket" in ln]
    if not res.get("ok"):
        res["log_tail"] = [ln for ln in text if ln.strip()][-25:]
    return res


def main() -> None:
    from rlslurm.settings.model_config import available_models

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("models", nargs="*", help="shipped model configs or model config files (default: every tiny-*)")
    ap.add_argument("--jobs", type=int, default=4, help="engines at once on the GPU")
    a = ap.parse_intermixed_args()  # `OUT --jobs 2 MODEL ...` as the docstring writes it
    a.out.mkdir(parents=True, exist_ok=True)
    names = a.models or [n for n in available_models() if n.startswith("tiny-")]
    for n in names:
        checkpoints(n, a.out)
    signal.signal(signal.SIGTERM, _stop)
    with ThreadPoolExecutor(a.jobs) as pool, open(a.out / "families.jsonl", "a") as f:
        for fut in as_completed([pool.submit(probe, n, a.out) for n in names]):
            r = fut.result()
            f.write(json.dumps(r) + "\n")
            f.flush()
            print(f"{r['model']}: {'ok' if r.get('ok') else 'FAILED'} {r.get('error', '')}", flush=True)


if __name__ == "__main__":
    main()
