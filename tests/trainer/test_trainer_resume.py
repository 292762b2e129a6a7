"""The trainer entry point end to end (torchrun, DP=2, gloo): train-only replay from another
run's buffer, and resume exactness: 4 rollouts straight == 2 + kill -9 + resume + 2, bit for bit,
with the plain and with megatron's distributed optimizer."""

from __future__ import annotations

import math
import signal
import time
from pathlib import Path

import pytest
from conftest import REPO, _pythonpath, commit_rollouts, kill_tree, make_run, metrics, run_trainer, start_trainer
from safetensors.torch import load_file

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

# GRPO with a KL loss against the frozen reference, an entropy bonus, two optimizer steps per rollout.
TRAIN = dict(use_kl_loss=True, kl_loss_coef=0.05, entropy_coef=0.01, save_interval=2, keep_checkpoints=2,
             num_steps_per_rollout=2, global_batch_size=4, micro_batch_size=1, weight_sync="disk",
             lr_decay_style="cosine", lr_warmup_iters=1)
ROLLOUT = dict(num_rollout=4)
LOGGED = ("loss", "pg_loss", "pg_clipfrac", "ppo_kl", "kl", "entropy", "grad_norm", "lr", "reward_mean", "reward_std",
          "response_length_mean", "truncation_rate", "train_rollout_logprob_abs_diff", "tokens_per_s",
          "time/actor_step", "time/old_logprob", "time/ref_logprob", "time/wait_rollout")


# The distributed optimizer shards Adam state over the 2 DP ranks and checkpoints it per bucket
# (dp_reshardable); fp32, because a wrong Adam step moves the weights by ~1e-4, under bf16's resolution.
OPTIMIZERS = {"plain": {}, "distributed": {"use_distributed_optimizer": True}}


def _straight(tmp: Path, tiny_hf: Path, train: dict) -> Path:
    """4 rollouts trained straight through, replayed from another run's buffer (no engine)."""
    source = make_run(tmp / "source", tiny_hf)
    commit_rollouts(source, range(4))
    run = make_run(tmp / "replay", tiny_hf, nproc=2, train={**train, "load_debug_rollout_data": str(source)},
                   rollout=ROLLOUT)
    out = run_trainer(run, nproc=2)
    (tmp / "trainer.log").write_text(out.stdout + out.stderr)  # what the job's trainer-0.log would hold
    return run


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tiny_hf) -> Path:
    tmp = tmp_path_factory.mktemp("straight")
    return _straight(tmp, tiny_hf, {**TRAIN, "save_hf": str(tmp / "hf" / "iter-{rollout_id}"),
                                    "save_debug_train_data": str(tmp / "train_data" / "{rollout_id}_{rank}.pt")})


@pytest.fixture(scope="module")
def straight_distributed(tmp_path_factory, tiny_hf) -> Path:
    return _straight(tmp_path_factory.mktemp("straight_distributed"), tiny_hf, {**TRAIN, **OPTIMIZERS["distributed"]})


def test_save_hf_writes_the_weights_with_each_save(straight: Path) -> None:
    """--save-hf PATTERN (slime's): with each checkpoint (save interval 2: after rollouts 1 and 3) the
    weights in HF format, the last bit for bit the published version 4, with config and tokenizer."""
    import torch

    hf = straight.parent / "hf"
    assert sorted(p.name for p in hf.iterdir()) == ["iter-1", "iter-3"]
    first, last = (load_file(str(hf / n / "model.safetensors")) for n in ("iter-1", "iter-3"))
    v4 = load_file(str(straight / "weights" / "v4" / "model.safetensors"))
    assert last.keys() == v4.keys() and all(torch.equal(last[k], v4[k]) for k in v4)
    assert any(not torch.equal(first[k], last[k]) for k in v4)  # trained in between
    assert (hf / "iter-3" / "config.json").exists() and (hf / "iter-3" / "tokenizer.json").exists()


def test_save_debug_train_data_has_every_sample_once_per_rollout(straight: Path) -> None:
    """--save-debug-train-data PATTERN (slime's): per rollout and rank what the loss is computed from;
    the two DP ranks' samples partition the rollout, each with per-token tensors of one length."""
    import torch

    d = straight.parent / "train_data"
    assert sorted(p.name for p in d.iterdir()) == [f"{r}_{k}.pt" for r in range(4) for k in range(2)]
    for r in range(4):
        parts = [torch.load(d / f"{r}_{k}.pt") for k in range(2)]
        assert [p["rollout_id"] for p in parts] == [r, r] and [p["rank"] for p in parts] == [0, 1]
        mine = [set(p["samples"]) for p in parts]
        assert mine[0] and mine[1] and not mine[0] & mine[1] and mine[0] | mine[1] == set(range(8))
        for p in parts:
            for i in p["samples"]:
                n = p["loss_masks"][i].numel()
                assert n > 0 and all(p[k][i].shape == (n,) for k in ("advantages", "returns", "old_logprobs",
                                                                        "ref_logprobs"))
                assert p["rollout_logprobs"] is None or p["rollout_logprobs"][i].shape == (n,)
                assert torch.isfinite(p["advantages"][i]).all()


def test_replay_trains_without_engines_and_logs_metrics(straight: Path) -> None:
    assert (straight / "FINISHED").exists()
    lines = metrics(straight)
    assert [l["step"] for l in lines] == list(range(8))
    for l in lines:
        for k in LOGGED:
            assert k in l and l[k] is not None and math.isfinite(l[k]), (k, l)
    assert lines[0]["lr"] < lines[2]["lr"]  # warm-up, then cosine decay
    assert lines[2]["lr"] > lines[-1]["lr"]
    assert any(l["kl"] > 0 for l in lines) and all(l["update_successful"] == 1.0 for l in lines)
    # checkpoints every 2 rollouts, the last 2 kept, `latest` on the newest
    ck = straight / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["iter_0000002", "iter_0000004", "latest"]
    assert '"iter_0000004"' in (ck / "latest").read_text()
    assert (straight / "weights" / "v4" / "model.safetensors").exists()
    assert list((straight / "tb").glob("events.out.tfevents.*"))  # TensorBoard next to metrics.jsonl
    # the replayed buffer is read-only: nothing retired or marked trained there
    assert not [p.name for p in (straight.parent / "source" / "buffer").rglob("*trained*")]


def test_a_runs_checkpoint_converts_to_the_published_weights(straight: Path, tmp_path: Path) -> None:
    """The README's export path: `rlslurm convert mcore-to-hf` of a run's checkpoint (which also holds
    the optimizer, scheduler and progress: the converter refused those keys) gives the weights the
    trainer published from it, bit for bit."""
    import os
    import subprocess
    import sys

    import torch


    out = tmp_path / "hf"
    p = subprocess.run([sys.executable, "-m", "rlslurm", "convert", "mcore-to-hf", "--model", "tiny-qwen3", "--load",
                        str(straight / "checkpoints" / "iter_0000004"), "--out", str(out)], capture_output=True,
                       text=True, timeout=300, cwd=REPO, env={**os.environ, "PYTHONPATH": _pythonpath()})
    assert p.returncode == 0, p.stderr[-3000:]
    got = load_file(str(out / "model.safetensors"))
    v4 = load_file(str(straight / "weights" / "v4" / "model.safetensors"))
    assert got.keys() == v4.keys() and all(torch.equal(got[k].to(v4[k].dtype), v4[k]) for k in v4)


def test_the_trainer_logs_one_line_per_step_from_its_metrics_record(straight: Path) -> None:
    """slime and verl print a line per step; the trainer's is made of the record metrics.jsonl got,
    by one formatter (rlslurm/step_line.py), after the rollout's publish: its version is on it."""
    from rlslurm.step_line import step_line

    log = (straight.parent / "trainer.log").read_text()
    lines = [l.split(" INFO ", 1)[1] for l in log.splitlines() if l.startswith("[trainer 0] ") and " | reward " in l]
    recs = metrics(straight)
    assert lines == [step_line(r) for r in recs]
    assert lines[0].startswith("rollout 0 step 0 | reward ") and " | kl " in lines[0]
    # each rollout's version went out by disk before its lines were written
    assert [l.rsplit(" | ", 1)[1] for l in lines] == [f"weights v{r // 2 + 1} disk" for r in range(8)]
    assert all(" | tok/s train " in l and ", iteration " in l for l in lines)


def test_the_trainer_names_the_layers_it_built(straight: Path) -> None:
    """Which --transformer-impl ran is read from the model, not the flag: the first attention layer's
    classes (megatron-core's local linears and rlslurm's SDPA core attention here, the default without
    transformer-engine: models/specs.py core_attention; transformer-engine's are named TE*:
    tests/gpu/test_colocate_te.py)."""
    import re

    log = (straight.parent / "trainer.log").read_text()
    [built] = re.findall(r"\[trainer 0\] .* models built, --transformer-impl local \(([^)]*)\)", log)
    pairs = dict(p.split("=") for p in built.split(", "))
    assert {"linear_qkv", "linear_proj", "core_attention"} <= pairs.keys(), built
    assert not any(c.startswith("TE") for c in pairs.values()), built
    assert pairs["core_attention"] == "SDPACoreAttention" and pairs["linear_qkv"] == "ColumnParallelLinear", built


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_kill_and_resume_is_bit_exact(optimizer: str, request: pytest.FixtureRequest, tmp_path: Path,
                                      tiny_hf: Path) -> None:
    straight = request.getfixturevalue("straight" if optimizer == "plain" else "straight_distributed")
    run = make_run(tmp_path / "run", tiny_hf, nproc=2, train={**TRAIN, **OPTIMIZERS[optimizer]}, rollout=ROLLOUT)
    commit_rollouts(run, range(2))
    log = tmp_path / "attempt0.log"
    proc = start_trainer(run, log)
    try:
        deadline = time.monotonic() + 240
        latest = run / "checkpoints" / "latest"
        while not latest.exists():
            assert proc.poll() is None, log.read_text()[-6000:]
            assert time.monotonic() < deadline, "no checkpoint after 2 rollouts"
            time.sleep(0.3)
        time.sleep(1.0)  # it is now waiting for rollout 2, which is never committed in this attempt
        assert proc.poll() is None, log.read_text()[-6000:]
    finally:
        kill_tree(proc)
    assert not (run / "FINISHED").exists()
    assert not (run / "weights" / "v3").exists()  # really stopped before rollout 2
    commit_rollouts(run, range(2, 4))
    p = run_trainer(run, nproc=2)
    assert "resumed from" in p.stderr and "iter_0000002" in p.stderr
    a = load_file(str(straight / "weights" / "v4" / "model.safetensors"))
    b = load_file(str(run / "weights" / "v4" / "model.safetensors"))
    assert a.keys() == b.keys()
    differ = [n for n in a if not (a[n] == b[n]).all()]
    assert not differ, differ
    # the resumed attempt re-published the checkpoint's weights (version 2) before training on
    lines = metrics(run)
    assert [l["rollout_id"] for l in lines if l["step"] % 2 == 0] == [0, 1, 2, 3]


def test_sigterm_checkpoints_and_acknowledges(tmp_path: Path, tiny_hf: Path) -> None:
    """SLURM ends a job (scancel, scontrol requeue, preemption) by TERMing every process of its steps,
    then KILLs them after KillWait: the trainer must save what it trained before then. The periodic
    save at rollout 2 comes first (the helper processes megatron's checkpoint writer keeps from it are
    TERMed too, as on a real requeue: docs/slurm-preemption.md), and only the TERM's own checkpoint
    can hold rollout 3."""
    import json

    import psutil

    run = make_run(tmp_path / "run", tiny_hf, nproc=2, train=TRAIN, rollout=ROLLOUT)
    commit_rollouts(run, range(3))
    log = tmp_path / "attempt0.log"
    proc = start_trainer(run, log)
    try:
        deadline = time.monotonic() + 240
        while not (run / "metrics.jsonl").exists() or len(metrics(run)) < 6:  # 3 rollouts x 2 steps
            assert proc.poll() is None, log.read_text()[-6000:]
            assert time.monotonic() < deadline, "3 rollouts not trained"
            time.sleep(0.3)
        time.sleep(1.0)  # now waiting for rollout 3, which never comes
        # TERM the whole step, as slurmstepd does, and keep TERMing every process of it, new ones too
        # (the helper processes megatron's checkpoint writer spawns must survive a later TERM)
        known = {proc.pid: psutil.Process(proc.pid)}
        deadline = time.monotonic() + 60
        while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in known.values()):
            assert time.monotonic() < deadline, log.read_text()[-6000:]
            for p in list(known.values()):
                try:
                    known.update({c.pid: c for c in p.children(recursive=True)})
                    p.send_signal(signal.SIGTERM)
                except psutil.NoSuchProcess:
                    pass
            time.sleep(0.1)
            proc.poll()  # reap torchrun
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    ack = json.loads((run / "control" / "preempt_ack.json").read_text())
    assert ack["checkpoint_iteration"] == 3, log.read_text()[-6000:]
    assert '"iter_0000003"' in (run / "checkpoints" / "latest").read_text()
    assert "SIGTERM" in log.read_text() and not (run / "FINISHED").exists()


def test_initial_weights_from_a_megatron_checkpoint(straight: Path, tmp_path: Path, tiny_hf: Path) -> None:
    """--load <checkpoints of another run>: the new run starts from those weights (not the HF
    ones) with fresh progress; a near-zero LR keeps the exported weights where they started."""
    source = straight.parent / "source"
    run = make_run(tmp_path / "run", None, nproc=1, rollout=dict(num_rollout=1), train=dict(
        lr=1e-12, num_steps_per_rollout=2, global_batch_size=4, load_debug_rollout_data=str(source)))
    import yaml

    cfg = yaml.safe_load((run / "run.yaml").read_text())
    cfg["model"]["load"] = str(straight / "checkpoints")
    (run / "run.yaml").write_text(yaml.safe_dump(cfg))
    run_trainer(run, nproc=1)
    got = load_file(str(run / "weights" / "v1" / "model.safetensors"))
    trained = load_file(str(straight / "weights" / "v4" / "model.safetensors"))
    init = load_file(str(tiny_hf / "model.safetensors"))
    assert max(float((got[n] - trained[n]).abs().max()) for n in got) < 1e-6
    assert max(float((got[n] - init[n]).abs().max()) for n in got) > 1e-4


def test_hf_config_mismatch_is_an_error_naming_the_field(tmp_path: Path, tiny_hf: Path) -> None:
    import json
    import shutil

    hf = tmp_path / "hf"
    shutil.copytree(tiny_hf, hf)
    c = json.loads((hf / "config.json").read_text())
    c["rms_norm_eps"] = 1e-5
    (hf / "config.json").write_text(json.dumps(c))
    run = make_run(tmp_path / "run", hf, nproc=1)
    commit_rollouts(run, range(1))
    p = run_trainer(run, nproc=1, check=False)
    assert p.returncode != 0
    assert "rms_norm_eps" in p.stderr and "config.json" in p.stderr, p.stderr[-3000:]
    assert not list((run / "checkpoints").iterdir())
