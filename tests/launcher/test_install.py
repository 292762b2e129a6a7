"""A regular (non-editable) install works away from the source tree.

Issue: model configs and the sbatch template were found through the source tree, so
`pip install .` gave `rlslurm models` an empty table and `submit` "unknown model". This builds the
wheel, installs it into a fresh venv and runs the CLI from an unrelated directory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers.prompt_files import prompt_lines

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy of the checkout's files (tracked, and untracked but not ignored): setuptools
    # reuses the checkout's own build/ directory, and a package file moved since an earlier build
    # was shipped from there at both its old and its new path.
    src = tmp_path_factory.mktemp("src")
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           check=True, capture_output=True, timeout=60).stdout.decode().split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    # --no-build-isolation: no index needed (the test machine's setuptools builds it)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(src)], check=True, cwd=out, timeout=300)
    (whl,) = out.glob("rlslurm-*.whl")
    return whl


def test_wheel_ships_the_package_data_and_nothing_beside_the_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.startswith("rlslurm-")}
    assert tops == {"rlslurm"}, tops  # a top-level `tools` would shadow users' own modules
    shipped = {n for n in names if n.endswith((".yaml", ".j2"))}
    in_tree = {str(p.relative_to(ROOT)) for p in (ROOT / "rlslurm").rglob("*") if p.suffix in (".yaml", ".j2")}
    assert in_tree and shipped == in_tree


def test_installed_wheel_lists_models_and_renders_a_job_from_another_directory(wheel, tmp_path):
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # a checkout on it would win
    # system site packages: the dependencies (pydantic, jinja2, ...) without an index; the wheel
    # itself goes into the venv and wins over any editable install of the source tree.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    py, cli = venv / "bin" / "python", venv / "bin" / "rlslurm"
    # --force-reinstall: the editable install of the checkout in the system site counts as installed
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--force-reinstall", str(wheel)],
                   check=True, timeout=300, env=env)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run([str(py), "-c", "import rlslurm; print(rlslurm.__file__)"], cwd=elsewhere,
                           capture_output=True, text=True, check=True, env=env).stdout.strip()
    assert where.startswith(str(venv)), where

    listed = subprocess.run([str(cli), "models", "--json"], cwd=elsewhere, capture_output=True, text=True,
                            timeout=120, env=env)
    assert listed.returncode == 0, listed.stderr
    names = {m["name"] for m in json.loads(listed.stdout)}
    assert {"qwen3-4B", "glm4-9B", "tiny-qwen3"} <= names

    (elsewhere / "train.jsonl").write_text(prompt_lines({"prompt": "1+1=", "label": "2"}))
    dry = subprocess.run([str(cli), "submit", "--model", "qwen3-4B", "--nodes", "2", "--prompt-data", "train.jsonl",
                          "--run-dir", "runs/r1", "--dry-run"], cwd=elsewhere, capture_output=True, text=True,
                         timeout=120, env=env)
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.startswith("#!/bin/bash") and "#SBATCH hetjob" in dry.stdout
    # the job runs in the run directory: the path it is given must not be relative to this shell
    assert f"RUN_DIR={elsewhere / 'runs' / 'r1'}" in dry.stdout
