"""Supported stacks as files (issue 48): rlslurm/stacks.py agrees with constraints/*.txt and with what
pyproject.toml's extras can resolve, and what each role runs is judged against it: a supported install
passes, anything else is one line naming what is installed and what is supported (docs/supported-stacks.md)."""

from __future__ import annotations

import logging
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from rlslurm import stacks
from rlslurm.errors import ConfigError
from rlslurm.stacks import STACKS, check_role

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "constraints"


def pins(path: Path) -> dict[str, str]:
    """name -> version of a constraints file's `name==version` lines."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            out[req.name.lower().replace("_", "-")] = spec.version
    return out


def test_every_stack_is_a_constraints_file_and_back() -> None:
    """One home: each STACKS entry's versions are its constraints file's pins, and every constraints file
    is a stack (tools/install.sh and tools/gpu/build-bundle.sh install from these files)."""
    assert sorted(p.name for p in CONSTRAINTS.glob("*.txt")) == sorted(Path(s.constraints).name for s in STACKS)
    for s in STACKS:
        pinned = pins(ROOT / s.constraints)
        for component in ("torch", "megatron-core", "sglang", "sglang-router", "transformers"):
            assert pinned[component] == s.version(component), (s.name, component)
        assert "transformer-engine" not in pinned and s.transformer_engine == ()  # nothing has run with TE
    assert pins(CONSTRAINTS / "gpu-torch211.txt")["torch-memory-saver"] == "0.0.10"  # what ran, not "newest"


def test_the_gpu_bundle_pins_nothing_itself() -> None:
    """tools/gpu/build-bundle.sh downloads with -c the GPU stack's file and names no version of its own
    (it used to repeat them, and left torch_memory_saver unpinned)."""
    script = (ROOT / "tools/gpu/build-bundle.sh").read_text()
    code = "\n".join(line.split("#", 1)[0] for line in script.splitlines())
    assert 'constraints/gpu-torch211.txt' in script and '-c "$C"' in code
    assert not re.search(r"[A-Za-z0-9_.-]==\d", code), re.findall(r"\S+==\S+", code)


# megatron-core releases on PyPI when this was written (`pip index versions megatron-core`, Python 3.12)
MEGATRON_RELEASES = ["0.15.3", "0.16.0", "0.16.1", "0.17.0", "0.17.1", "0.18.0", "0.18.2", "0.19.0", "0.19.2"]


def test_pyproject_resolves_only_what_ran() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    reqs = {name: [Requirement(r) for r in deps] for name, deps in extras.items()}
    [mcore] = [r for r in reqs["train"] if r.name == "megatron-core"]
    admitted = [v for v in MEGATRON_RELEASES if mcore.specifier.contains(v)]
    assert admitted == sorted({s.megatron_core for s in STACKS}, key=stacks.release) == ["0.16.1", "0.19.2"]
    gpu = {s.sglang_extra: s for s in STACKS if s.sglang_extra}
    for name, rs in reqs.items():
        for r in rs:
            assert r.name != "transformer-engine", (name, r)  # no `te` extra: nothing has run with it
            if r.name == "sglang":  # every SGLang an extra installs is a GPU stack's, through that stack's extra
                assert name in gpu and str(r.specifier) == f"=={gpu[name].sglang}", (name, r)
    assert set(gpu) == {"sglang-torch211"} and "sglang" not in extras  # 0.5.23 pins torch 2.14.1: never ran


# Installed versions as package metadata reports them: the CI environment (constraints/cpu.txt), CI's second
# environment (torch 2.11 CPU + megatron-core 0.19.2 on Python 3.12, no SGLang) and the GPU image with the bundle.
CPU = {"torch": "2.13.0+cpu", "megatron-core": "0.16.1", "sglang": "0.5.23", "transformers": "5.19.0"}
SECOND = {"torch": "2.11.0+cpu", "megatron-core": "0.19.2", "sglang": None, "transformers": "5.8.1"}
GPU = {"torch": "2.11.0+cu130", "megatron-core": "0.19.2", "sglang": "0.5.14", "transformers": "5.8.1"}


@pytest.mark.parametrize("role, found, engines, stack", [
    ("trainer", CPU, True, "cpu"), ("rollout", CPU, True, "cpu"), ("convert", CPU, True, "cpu"),
    ("trainer", GPU, True, "gpu-torch211"), ("rollout", GPU, True, "gpu-torch211"),
    ("trainer", SECOND, True, "gpu-torch211"), ("convert", SECOND, True, "gpu-torch211"),
    ("rollout", SECOND, False, None),  # a replay or SFT rollout starts no engine: no torch, no SGLang to check
])
def test_supported_installs_pass_each_role(role: str, found: dict, engines: bool, stack: str | None) -> None:
    got = check_role(role, allow_untested=False, engines=engines, te=False, found=found)
    assert (got.name if got else None) == stack


@pytest.mark.parametrize("role, found, te, says", [
    # a mix: each version is a stack's, not the same one's
    ("trainer", {**SECOND, "megatron-core": "0.16.1"}, False,
     r"^trainer stack: installed torch 2\.11\.0\+cpu, megatron-core 0\.16\.1: not a supported stack \(a mix of torch "
     r"2\.11\.0\+cpu \(stack gpu-torch211\) and megatron-core 0\.16\.1 \(stack cpu\)\); supported: stack cpu: torch "
     r"2\.13\.0, megatron-core 0\.16\.1; stack gpu-torch211: torch 2\.11\.0, megatron-core 0\.19\.2; install one with "
     r"its constraints file \(docs/supported-stacks\.md\), or --allow-untested-stack to try it$"),
    ("trainer", {**GPU, "megatron-core": "0.18.2"}, False,
     r"megatron-core 0\.18\.2 is not a supported version \(0\.16\.1, 0\.19\.2\)"),
    # what pip installs with SGLang 0.5.23 on a GPU node: its pinned torch, which no stack has
    ("rollout", {**CPU, "torch": "2.14.1+cu130"}, False, r"torch 2\.14\.1\+cu130 is not a supported version"),
    ("rollout", SECOND, False, r"^rollout stack: sglang is not installed; install a supported stack"),
    # the trainer builds with transformer-engine whenever it is importable (models/build.py HAVE_TE)
    ("trainer", {**GPU, "transformer-engine": "2.9.0"}, True,
     r"transformer-engine 2\.9\.0 is installed and the trainer would use it, but no supported stack has run with "
     r"transformer-engine\); supported: stack cpu: torch 2\.13\.0, megatron-core 0\.16\.1, no transformer-engine"),
    ("convert", {**CPU, "transformers": None}, False, r"^convert stack: transformers is not installed"),
])
def test_anything_else_is_one_line_naming_installed_and_supported(role: str, found: dict, te: bool, says: str) -> None:
    with pytest.raises(ConfigError, match=says) as e:
        check_role(role, allow_untested=False, te=te, found=found)
    assert "\n" not in str(e.value)


def test_the_flag_makes_untested_a_warning_but_not_a_missing_component(caplog) -> None:
    mix = {**SECOND, "megatron-core": "0.16.1"}
    with caplog.at_level(logging.WARNING, logger="rlslurm.stacks"):
        assert check_role("trainer", allow_untested=True, te=False, found=mix) is None
    assert "trainer stack: installed torch 2.11.0+cpu, megatron-core 0.16.1: not a supported stack" in caplog.text
    assert "going on as --allow-untested-stack asks" in caplog.text
    warnings: list[str] = []
    check_role("trainer", allow_untested=True, te=False, found=mix, warnings=warnings)
    assert len(warnings) == 1 and warnings[0].startswith("trainer stack: installed")
    with pytest.raises(ConfigError, match="^rollout stack: sglang is not installed"):
        check_role("rollout", allow_untested=True, found=SECOND)


def test_installed_te_counts_only_when_the_trainer_would_use_it() -> None:
    with_te = {**CPU, "transformer-engine": "2.9.0"}
    assert check_role("trainer", allow_untested=False, te=False, found=with_te).name == "cpu"
    assert check_role("rollout", allow_untested=False, te=True, found=with_te).name == "cpu"  # the engines' own


def test_the_readmes_install_lines_install_a_stack_that_ran() -> None:
    """Every `pip install` line of the README's Install section pins a constraints file, and an SGLang extra
    it names is that same stack's (the former `.[train,rollout,sglang]` resolved SGLang 0.5.23 with torch
    2.14.1, which nobody ran on a GPU)."""
    section = (ROOT / "README.md").read_text().split("### Install\n", 1)[1].split("\n### ", 1)[0]
    lines = [line.strip() for line in section.splitlines() if line.strip().startswith("pip install")]
    assert lines
    by_file = {s.constraints: s for s in STACKS}
    for line in lines:
        m = re.match(r"pip install -c (\S+) (\S+)", line)
        assert m and m[1] in by_file, line
        extras = {e for group in re.findall(r"\[([^\]]+)\]", m[2]) for e in group.split(",")}
        assert {e for e in extras if e.startswith("sglang")} <= {by_file[m[1]].sglang_extra}, line
