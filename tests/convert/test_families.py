"""The family registry (rlslurm/models/family.py): every model config resolves to exactly one family,
every released config.json's model_type is served or refused in one line, and reading the registry
costs no torch import (the login side and the rollout node read it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlslurm.errors import ConfigError
from rlslurm.models.family import family_names, family_of, needs_remote_code, registry, remote_base
from rlslurm.models.hf_config import check_hf_config
from rlslurm.settings.model_config import MODEL_CONFIG_DIR, available_models, load_model_config

ROOT = Path(__file__).resolve().parents[2]
RELEASES = sorted(p for p in (ROOT / "tests/fixtures/release_configs").glob("*/config.json"))


@pytest.mark.parametrize("name", available_models())
def test_every_model_config_resolves_to_exactly_one_family(name):
    mt = load_model_config(name).hf_model_type
    serving = [f.name for f in dict.fromkeys(registry().values()) if mt in f.model_types]
    assert serving == [family_of(mt).name], (name, mt, serving)


def test_every_family_has_a_model_config():
    used = {family_of(load_model_config(n).hf_model_type).name for n in available_models()}
    assert used == set(family_names()), f"families without a YAML in {MODEL_CONFIG_DIR}: {set(family_names()) - used}"


def test_a_model_type_is_served_by_one_family_only():
    seen: dict[str, str] = {}
    for family in dict.fromkeys(registry().values()):
        for mt in family.model_types:
            assert seen.setdefault(mt, family.name) == family.name, (mt, seen[mt], family.name)
    assert family_of("kimi_k2").name == "deepseek_v3" and remote_base("kimi_k2") is None
    assert remote_base("mimo") == "qwen2" and needs_remote_code("mimo") and not needs_remote_code("qwen2")


@pytest.mark.parametrize("path", RELEASES, ids=lambda p: p.parent.name)
def test_every_release_model_type_is_served_or_refused_in_one_line(path, tmp_path):
    mt = json.loads(path.read_text())["model_type"]
    if family_of(mt) is not None:
        return
    with pytest.raises(ConfigError) as e:
        check_hf_config(load_model_config("tiny-qwen3"), path.parent)
    assert "\n" not in str(e.value) and f"model_type={mt!r} has no mapping" in str(e.value)


def test_an_unserved_model_type_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError) as e:
        check_hf_config(load_model_config("tiny-qwen3"), tmp_path)
    assert "\n" not in str(e.value) and "supported: " + ", ".join(family_names()) in str(e.value)


def test_releases_are_all_served():
    """Today every release config in tests/fixtures is of a served family (the parametrized test above
    would otherwise check its refusal)."""
    assert RELEASES and all(family_of(json.loads(p.read_text())["model_type"]) for p in RELEASES)


def test_the_registry_imports_no_torch():
    code = ("import sys\nfrom rlslurm.models.family import registry\nfrom rlslurm.models import hf_config\n"
            "registry()\nassert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr
