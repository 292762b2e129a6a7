"""No test module imports another test module: shared helpers and fixtures live in helper
modules (tests/helpers/ for several areas, tests/<area>/helpers.py for one) or in a conftest.py.
tests/ itself holds only conftest.py and test modules.

Importing a test module runs it a second time under another name (pytest's rootdir-relative
name and the `tests.` package name), so its tests can be collected twice and its module-level
state exists twice; a helper module has neither problem.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imported_test_modules(tree: ast.AST) -> list[str]:
    """The imported modules (or names imported from a package) whose last part is test_*."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.rsplit(".", 1)[-1].startswith("test_")]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if mod.rsplit(".", 1)[-1].startswith("test_"):
                found.append("." * node.level + mod)
            else:  # `from tests.area import test_x` or `from . import test_x`
                prefix = "." * node.level + (mod + "." if mod else "")
                found += [prefix + a.name for a in node.names if a.name.startswith("test_")]
    return found


def test_no_test_module_imports_another_test_module() -> None:
    ours = {p.stem for p in TESTS.rglob("test_*.py")}
    bad = [f"{p.relative_to(TESTS.parent)}: imports {name}"
           for p in sorted(TESTS.rglob("*.py"))
           for name in imported_test_modules(ast.parse(p.read_text(), str(p)))
           if name.rsplit(".", 1)[-1] in ours]
    assert not bad, "move the shared code into a helpers module or conftest.py:\n" + "\n".join(bad)


def test_the_scan_sees_every_import_form() -> None:
    src = ("import tests.rollout.test_driver\nfrom tests.buffer.test_enospc import small_fs\n"
           "from test_trainer_resume import _start\nfrom .test_corruption import truncate\n"
           "from tests.e2e import test_grpo_slurm\nfrom . import test_driver\n"
           "from tests.rollout.helpers import make_cfg\n")
    assert imported_test_modules(ast.parse(src)) == [
        "tests.rollout.test_driver", "tests.buffer.test_enospc", "test_trainer_resume", ".test_corruption",
        "tests.e2e.test_grpo_slurm", ".test_driver"]


def test_shared_helpers_live_in_tests_helpers() -> None:
    top = sorted(p.name for p in TESTS.glob("*.py") if p.name != "conftest.py" and not p.name.startswith("test_"))
    assert not top, f"move these into tests/helpers/: {top}"
