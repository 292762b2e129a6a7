"""An install outside the supported stacks (rlslurm/stacks.py) is one line at submit, where the job runs
this environment, and a user error at each role's start (issue 48; docs/supported-stacks.md): the
launcher on each node, the trainer's and the rollout's main, a conversion."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.cli_proc import run
from tests.helpers.hf_shape import hf_shaped_dir
from tests.helpers.prompt_files import prompt_lines


def fake_dists(where: Path, **versions: str) -> Path:
    """An INVENTED install: package metadata (a dist-info directory, what pip writes) claiming these
    versions, put first on PYTHONPATH, so that this machine's real torch and megatron-core report another
    release to importlib.metadata, the one source rlslurm/stacks.py reads."""
    where.mkdir(parents=True, exist_ok=True)
    for name, version in versions.items():
        d = where / f"{name.replace('-', '_')}-{version}.dist-info"
        d.mkdir()
        (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return where


@pytest.fixture(scope="module")
def tiny_run_dir(tmp_path_factory) -> Path:
    """A run directory as `rlslurm submit` writes it, whose engines would serve --hf-checkpoint (the
    stack is checked before anything reads it, so a checkpoint's shape without weights does)."""
    from rlslurm.resolve import resolve
    from rlslurm.slurm.submit import prepare_run_dir

    base = tmp_path_factory.mktemp("stack-run")
    (base / "p.jsonl").write_text(prompt_lines())
    res = resolve(["--model", "tiny-qwen3", "--nodes", "2", "--prompt-data", str(base / "p.jsonl"), "--hf-checkpoint",
                   str(hf_shaped_dir(base / "hf", "tiny-qwen3")), "--run-dir", str(base / "run")])
    return prepare_run_dir(res).path


def test_an_untested_megatron_is_refused_at_submit_and_at_the_trainers_start(tmp_path: Path,
                                                                             tiny_run_dir: Path) -> None:
    env = {"PYTHONPATH": str(fake_dists(tmp_path / "dists", **{"megatron-core": "0.17.0"})), "RLSLURM_ATTEMPT": "0"}
    v = run("-m", "rlslurm", "--version", env_extra=env)
    assert v.returncode == 0 and "megatron-core 0.17.0" in v.stdout.splitlines(), v.stdout
    assert ("stack: not supported: megatron-core 0.17.0 is not a supported version (0.16.1, 0.19.2) "
            "(docs/supported-stacks.md)") in v.stdout.splitlines()
    assert "trainer stack: not supported" in v.stdout and "rollout stack: cpu (" in v.stdout  # which half is one

    (tmp_path / "p.jsonl").write_text(prompt_lines())
    argv = ["-m", "rlslurm", "submit", "--model", "tiny-qwen3", "--nodes", "2", "--prompt-data",
            str(tmp_path / "p.jsonl"), "--run-dir", str(tmp_path / "r"), "--dry-run"]
    s = run(*argv, env_extra=env)
    assert s.returncode == 2 and s.stdout == "", s.stdout
    assert s.stderr.count("\n") == 1 and s.stderr.startswith(
        "error: trainer stack: installed torch "), s.stderr
    assert "megatron-core 0.17.0: not a supported stack (megatron-core 0.17.0 is not a supported version" in s.stderr
    # the job runs another environment: each role checks there
    other = run(*argv, "--python", "/opt/other/bin/python3", env_extra=env)
    assert other.returncode == 0 and other.stdout.startswith("#!/bin/bash"), other.stderr
    assert "note: the job runs another Python environment: each role checks its torch" in other.stderr
    allowed = run(*argv, "--allow-untested-stack", env_extra=env)
    assert allowed.returncode == 0 and allowed.stdout.startswith("#!/bin/bash"), allowed.stderr
    assert "warning: trainer stack: installed" in allowed.stderr and "going on as --allow-untested-stack asks" in \
        allowed.stderr

    # on the node: the launcher (before torchrun imports torch) and the trainer's own start, each a user error
    for args in (["-m", "rlslurm.slurm.launch", "trainer", "--run-dir", str(tiny_run_dir), "--master-addr",
                  "127.0.0.1", "--master-port", "1"], ["-m", "rlslurm.trainer.main", "--run-dir", str(tiny_run_dir)]):
        p = run(*args, env_extra=env)
        assert p.returncode == 3, (args, p.stderr[-2000:])
        assert "rlslurm trainer: error: trainer stack: installed torch" in p.stderr and "Traceback" not in p.stderr
        rec = tiny_run_dir / "logs" / "attempt-0" / "user_error.json"
        reason = json.loads(rec.read_text())["reason"]
        assert reason.startswith("user error: trainer stack: installed torch") and "megatron-core 0.17.0" in reason
        rec.unlink()
    c = run("-m", "rlslurm.convert", "hf-to-mcore", "--model", "tiny-qwen3", "--hf", str(tmp_path), "--out",
            str(tmp_path / "out"), env_extra=env)
    assert c.returncode == 2 and c.stderr.startswith("error: convert stack: installed torch"), c.stderr
    assert c.stderr.count("\n") == 1 and not (tmp_path / "out").exists()


def test_an_untested_sglang_is_refused_at_the_rollouts_start(tmp_path: Path, tiny_run_dir: Path) -> None:
    env = {"PYTHONPATH": str(fake_dists(tmp_path / "dists", sglang="0.5.20")), "RLSLURM_ATTEMPT": "0"}
    for args in (["-m", "rlslurm.slurm.launch", "rollout", "--run-dir", str(tiny_run_dir), "--master-addr",
                  "127.0.0.1", "--master-port", "1"],
                 ["-m", "rlslurm.rollout.main", "--run-dir", str(tiny_run_dir), "--trainer-addr", "127.0.0.1"]):
        p = run(*args, env_extra=env)
        assert p.returncode == 3, (args, p.stderr[-2000:])
        rec = tiny_run_dir / "logs" / "attempt-0" / "user_error.json"
        reason = json.loads(rec.read_text())["reason"]
        assert reason.startswith("user error: rollout stack: installed torch") and \
            "sglang 0.5.20: not a supported stack (sglang 0.5.20 is not a supported version (0.5.14, 0.5.23))" in reason
        rec.unlink()
