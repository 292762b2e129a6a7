"""The two roles are peers: rlslurm.trainer (het-group 0) and rlslurm.rollout (het-group 1) never
import each other, and rlslurm.engines, which both use, imports neither. Checked on the source
with `ast` (nothing is imported), so a lazy import inside a function counts as well."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "rlslurm"
FORBIDDEN = {"trainer": ("rollout",), "rollout": ("trainer",), "engines": ("trainer", "rollout")}
# a module named in a string (importlib.import_module, `python -m ...`) is a dependency too
MODULE_STRING = re.compile(r"^rlslurm\.(\w+)(?:[.:]|$)")


def _imports(path: Path, pkg: Path) -> list[tuple[int, str]]:
    """(line, module) for every module `path` (a file under `pkg`, the rlslurm package) imports
    or names in a string."""
    package = ".".join(("rlslurm", *path.parent.relative_to(pkg).parts))
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]  # `from rlslurm import rollout`
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_STRING.match(node.value):
            out.append((node.lineno, node.value))
    return out


def violations(pkg: Path = PKG) -> list[str]:
    bad = []
    for role, banned in FORBIDDEN.items():
        for path in sorted((pkg / role).rglob("*.py")):
            seen = set()
            for line, module in _imports(path, pkg):
                m = MODULE_STRING.match(module)
                if m and m.group(1) in banned and line not in seen:
                    seen.add(line)
                    bad.append(f"rlslurm/{path.relative_to(pkg)}:{line}: rlslurm.{role} uses {module}")
    return bad


def test_roles_are_peers_and_engines_stand_alone():
    assert violations() == [], "\n".join(violations())


@pytest.mark.parametrize("role, source, banned", [
    ("trainer", "from rlslurm.rollout.sglang_client import SGLangClient\n", True),
    ("trainer", "def f():\n    from rlslurm import rollout\n", True),
    ("rollout", "import rlslurm.trainer.weight_sync\n", True),
    ("engines", "from ..trainer import collectives\n", True),
    ("engines", "CMD = ['-m', 'rlslurm.rollout.main']\n", True),
    ("rollout", "from rlslurm.engines.engine import EngineSpec\n", False),
    ("trainer", "from rlslurm.engines.fanout import Engines\n", False),
])
def test_the_check_sees_each_form(tmp_path, role, source, banned):
    (tmp_path / role).mkdir()
    (tmp_path / role / "mod.py").write_text(source)
    found = violations(tmp_path)
    assert bool(found) == banned, found
