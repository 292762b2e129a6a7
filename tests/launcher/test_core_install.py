"""A login node without torch (issue 48 item 6): `pip install .` with the core dependencies only (no torch,
transformers or megatron-core) submits a job that runs another Python environment, reading
--hf-checkpoint's safetensors headers and config.json without torch; what needs torch is checked on the
node, where a missing stack is one line and a user error (docs/supported-stacks.md). Everything here runs
in a real venv of that install (PyPI for the dependencies), made once per session."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.prompt_files import prompt_lines

pytestmark = pytest.mark.slow  # the venv: a wheel build and a pip install, ~30 s once per session

ROOT = Path(__file__).resolve().parents[2]
STACK = ("torch", "transformers", "megatron", "sglang")


@pytest.fixture(scope="session")
def core_venv(tmp_path_factory) -> Path:
    """The venv's python: rlslurm's wheel and its core dependencies, nothing else (no system site)."""
    base = tmp_path_factory.mktemp("core-venv")
    src = base / "src"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           check=True, capture_output=True, timeout=60).stdout.decode().split("\0")
    # a copy: the checkout's own build/ would be reused (tests/launcher/test_install.py)
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(base / "whl"), str(src)], check=True, timeout=300, cwd=base)
    (wheel,) = (base / "whl").glob("rlslurm-*.whl")
    # without pip of its own (ensurepip takes seconds): this interpreter's pip installs into it
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(base / "venv")], check=True, timeout=120)
    py = base / "venv" / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--disable-pip-version-check",
                    str(wheel)], check=True, timeout=600, env=env, cwd=base)
    found = subprocess.run([str(py), "-c", f"import importlib.util as u; print([m for m in {list(STACK)!r} if "
                            "u.find_spec(m)])"], capture_output=True, text=True, env=env, check=True).stdout.strip()
    assert found == "[]", found  # the core install has none of the stack
    return py


def run(py: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the venv's rlslurm, not the checkout
    return subprocess.run([str(py), *args], capture_output=True, text=True, timeout=300, env={**env, "COLUMNS": "200",
                          "RLSLURM_ATTEMPT": "0"}, cwd=cwd)


def test_version_and_doctor_on_a_login_node(core_venv: Path, tmp_path: Path) -> None:
    v = run(core_venv, "-m", "rlslurm", "--version", cwd=tmp_path)
    assert v.returncode == 0, v.stderr
    assert "torch not installed" in v.stdout and v.stdout.splitlines()[-1] == (
        "stack: none installed (enough to submit jobs that run another Python environment: --python, "
        "--container-image, --apptainer-image)")
    d = run(core_venv, "-m", "rlslurm", "doctor", "--json", cwd=tmp_path)
    assert d.returncode == 1, d.stderr  # not a node that can run a role
    facts = json.loads(d.stdout)
    assert facts["stack"]["supported"] is False and facts["torch_imports"] is False
    assert facts["stack"]["why"] == "torch and megatron-core and sglang and transformers not installed"


def test_a_job_that_runs_another_python_submits_from_a_login_node_without_torch(
        core_venv: Path, tiny_model: Path, tmp_path: Path) -> None:
    """--hf-checkpoint is a real tiny checkpoint (rlslurm.tiny, with transformers): before, reading its
    index imported torch (convert/hf_io.py) and the dry run ended in a 50-line traceback."""
    (tmp_path / "p.jsonl").write_text(prompt_lines())
    argv = ["-m", "rlslurm", "submit", "--model", "tiny-qwen3", "--nodes", "2", "--prompt-data", "p.jsonl",
            "--hf-checkpoint", str(tiny_model), "--run-dir", "runs/r"]
    for where in (["--python", "/opt/env/bin/python3"], ["--container-image", "nvcr.io#nvidia/pytorch:25.01-py3"],
                  ["--apptainer-image", "/images/rl.sif"]):
        p = run(core_venv, *argv, *where, "--dry-run", cwd=tmp_path)
        assert p.returncode == 0 and p.stdout.startswith("#!/bin/bash"), (where, p.stderr[-3000:])
        assert "Traceback" not in p.stderr
        # config.json compared as written: what it leaves out is named, and left to the trainer
        assert (f"warning: --hf-checkpoint {tiny_model}: transformers is not installed here, so config.json was read "
                "as written; what it leaves out (") in p.stderr, p.stderr
        assert "note: the job runs another Python environment: each role checks its torch" in p.stderr
    # a wrong --model is still refused here, by the fields config.json has
    wrong = run(core_venv, *[a if a != "tiny-qwen3" else "qwen3-4B" for a in argv], "--python", "/x/python3",
                "--dry-run", cwd=tmp_path)
    assert wrong.returncode == 2 and wrong.stderr.count("\n") == 1, wrong.stderr
    assert f"does not match {tiny_model}/config.json: arch.num_layers=36 but HF num_hidden_layers=2" in wrong.stderr
    # without --model the architecture needs transformers' reading of config.json: one line asking for --model
    bare = run(core_venv, *[a for a in argv if a not in ("--model", "tiny-qwen3")], "--python", "/x/python3",
               "--dry-run", cwd=tmp_path)
    assert bare.returncode == 2 and bare.stderr.count("\n") == 1, bare.stderr
    assert "without --model the architecture is read from config.json with transformers, which is not installed " \
           "here: pass --model NAME" in bare.stderr
    # a random-init tiny model (no --hf-checkpoint) would be written here with torch: refused before the run dir
    init = run(core_venv, *argv[:argv.index("--hf-checkpoint")], "--run-dir", "runs/init", "--container-image",
               "img:1", cwd=tmp_path)
    errors = [line for line in init.stderr.splitlines() if not line.startswith(("note: ", "warning: "))]
    assert init.returncode == 2 and len(errors) == 1, init.stderr
    assert "submit writes a random-init checkpoint (RUN/hf_init) with torch and transformers" in errors[0]
    assert not (tmp_path / "runs" / "init").exists()


def test_a_node_without_torch_fails_its_role_in_one_line(core_venv: Path, tiny_model: Path, tmp_path: Path) -> None:
    """The run directory as `rlslurm submit` writes it (its sbatch aside), then each het group's launcher on
    a "node" of the same install: the stack check refuses before torchrun would import torch."""
    (tmp_path / "p.jsonl").write_text(prompt_lines())
    make = ("import sys\nfrom rlslurm.resolve import resolve\nfrom rlslurm.slurm.submit import prepare_run_dir\n"
            "print(prepare_run_dir(resolve(sys.argv[1:])).path)\n")
    made = run(core_venv, "-c", make, "--model", "tiny-qwen3", "--nodes", "2", "--prompt-data", "p.jsonl",
               "--hf-checkpoint", str(tiny_model), "--container-image", "img:1", "--run-dir", "run", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    run_dir = Path(made.stdout.strip())
    for role, needs in (("trainer", "torch, megatron-core and transformers are not installed"),
                        ("rollout", "torch, sglang and transformers are not installed")):
        p = run(core_venv, "-m", "rlslurm.slurm.launch", role, "--run-dir", str(run_dir), "--master-addr",
                "127.0.0.1", "--master-port", "1", cwd=tmp_path)
        assert p.returncode == 3 and "Traceback" not in p.stderr, p.stderr
        cpu, gpu = ("megatron-core 0.16.1", "megatron-core 0.19.2") if role == "trainer" else \
            ("sglang 0.5.23", "sglang 0.5.14")
        assert p.stderr.splitlines()[0] == (f"rlslurm {role}: error: {role} stack: {needs}; install a supported stack "
                                            "with its constraints file (docs/supported-stacks.md): stack cpu: torch "
                                            f"2.13.0, {cpu}; stack gpu-torch211: torch 2.11.0, {gpu}")
        rec = run_dir / "logs" / "attempt-0" / "user_error.json"
        assert json.loads(rec.read_text())["reason"] == f"user error: {p.stderr.splitlines()[0].split(': error: ')[1]}"
        rec.unlink()


def test_config_json_read_without_transformers_agrees_with_transformers(core_venv: Path, tmp_path: Path) -> None:
    """Every released config.json the tests carry (tests/helpers/released_configs.py) and every
    shipped model's: the model transformers builds from it (here) passes the comparison the login node
    makes without transformers (there), and a model of another size is refused by a field the file has."""
    from rlslurm.models.model_from_hf import model_config_from_hf
    from rlslurm.settings.model_config import available_models, load_model_config
    from rlslurm.tiny import hf_config_dict
    from tests.helpers import released_configs as released

    configs = {n: getattr(released, n) for n in ("GLM47_FLASH", "MIMO_7B", "MINIMAX_M2", "QWEN3_NEXT", "QWEN3_5_27B",
                                                   "QWEN3_5_35B_A3B", "GLM5")}
    configs.update({m: hf_config_dict(load_model_config(m)) for m in available_models()})
    models = {}
    for name, cfg in configs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        models[name] = model_config_from_hf(tmp_path / name).model_dump(mode="json")
    (tmp_path / "models.json").write_text(json.dumps(models))
    check = ("import json, sys\nfrom pathlib import Path\nfrom rlslurm.models.hf_config import check_hf_config\n"
             "from rlslurm.errors import UserError\nfrom rlslurm.settings.model_config import ModelConfig\n"
             "models = json.loads(Path('models.json').read_text())\nout = {}\n"
             "for name, m in models.items():\n"
             "    out[name] = check_hf_config(ModelConfig.model_validate(m), Path(name))\n"
             "    m['arch']['num_layers'] += 1\n"
             "    try:\n        check_hf_config(ModelConfig.model_validate(m), Path(name))\n"
             "    except UserError as e:\n        out[name + ' +1 layer'] = str(e)\n"
             "print(json.dumps(out))\n")
    p = run(core_venv, "-c", check, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    for name in configs:
        assert isinstance(out[name], list), (name, out[name])  # compared, nothing refused; the rest is named
        assert "num_hidden_layers" in out[f"{name} +1 layer"], out.get(f"{name} +1 layer")
    assert out["QWEN3_5_27B"] == [] and "layer_types" in out["QWEN3_NEXT"]  # Qwen3-Next's comes from its interval
