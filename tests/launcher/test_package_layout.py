"""The two roles are peers: rlslurm.trainer (het-group 0) and rlslurm.rollout (het-group 1) never
import each other, and rlslurm.engines, which both use, imports neither; and nothing that runs on
the job's nodes (the roles, the engines, the buffer, rlslurm.job, rlslurm.models) depends on the
login side (the CLI, `rlslurm run`, rlslurm/slurm/, the submit-time checks). Followed through every
module in between (a module can reach the rollout through one in between, as trainer/setup.py once
did through preflight.py, which a check of direct imports does not see). Checked on the source with
`ast` (nothing is imported), so a lazy import inside a function counts as well.

"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "rlslurm"
# rlslurm.models (the model families, the config.json relation, the megatron-core build) is below the
# trainer and rlslurm.convert, which both use it: it imports neither, nor the rollout, nor rlslurm.tiny
# (the tiny checkpoint writer reads the families, never the other way round)
FORBIDDEN = {"trainer": ("rollout",), "rollout": ("trainer",), "engines": ("trainer", "rollout"),
             "models": ("trainer", "rollout", "convert", "tiny")}
NODE_SIDE = ("trainer", "rollout", "engines", "buffer", "job", "models")
# the login side: what assembles and checks a config and submits it (rlslurm.settings is below both sides)
LOGIN_SIDE = ("slurm", "cli", "local", "preflight", "resolve", "slime_import")
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


def _graph(pkg: Path) -> dict[str, dict[str, int]]:
    """module -> {rlslurm module it imports: line}, for every module of the package at `pkg`."""
    files = {}
    for path in pkg.rglob("*.py"):
        parts = path.relative_to(pkg).with_suffix("").parts
        files[".".join(("rlslurm", *(parts[:-1] if parts[-1] == "__init__" else parts)))] = path

    def known(module: str) -> str:  # `from rlslurm.x import name`: the longest prefix that is a module
        parts = module.split(":")[0].split(".")
        while len(parts) > 2 and ".".join(parts) not in files:
            parts.pop()
        return ".".join(parts)

    graph: dict[str, dict[str, int]] = {}
    for name, path in files.items():
        deps = graph.setdefault(name, {})
        for line, module in _imports(path, pkg):
            target = known(module) if MODULE_STRING.match(module) else None
            if target and target != name and target != "rlslurm":
                deps.setdefault(target, line)
    return graph


def _top(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def _under(module: str, places: tuple[str, ...]) -> bool:
    """`module` is one of `places` (dotted, below rlslurm: "slurm", "slime_import") or inside one."""
    inner = module.split(".", 1)[1] if module.count(".") else ""
    return any(inner == p or inner.startswith(p + ".") for p in places)


def _chain(graph: dict[str, dict[str, int]], start: str, banned: tuple[str, ...]) -> list[str] | None:
    """The shortest import chain from `start` to a module under rlslurm.<banned>, or None."""
    came_from: dict[str, str | None] = {start: None}
    queue = [start]
    for module in queue:
        for dep in graph.get(module, {}):
            if dep in came_from:
                continue
            came_from[dep] = module
            if _under(dep, banned):
                chain = [dep]
                while (prev := came_from[chain[-1]]) is not None:
                    chain.append(prev)
                return chain[::-1]
            queue.append(dep)
    return None


def violations(pkg: Path = PKG) -> list[str]:
    graph = _graph(pkg)
    rules = [*FORBIDDEN.items(), *((side, LOGIN_SIDE) for side in NODE_SIDE)]
    bad = []
    for role, banned in rules:
        for module in sorted(m for m in graph if _top(m) == role):
            if chain := _chain(graph, module, banned):
                first = f"rlslurm/{'/'.join(module.split('.')[1:])}.py:{graph[module][chain[1]]}"
                bad.append(f"{first}: rlslurm.{role} reaches {chain[-1]} ({' -> '.join(chain)})")
    return bad


def test_roles_are_peers_and_engines_stand_alone():
    assert violations() == [], "\n".join(violations())


@pytest.mark.parametrize("role, source, banned", [
    ("trainer", "from rlslurm.rollout.sglang_client import SGLangClient\n", True),
    ("trainer", "def f():\n    from rlslurm import rollout\n", True),
    ("rollout", "import rlslurm.trainer.weights.broadcast\n", True),
    ("engines", "from ..trainer import collectives\n", True),
    ("engines", "CMD = ['-m', 'rlslurm.rollout.main']\n", True),
    ("trainer", "from rlslurm.checks import refusal\n", True),       # through a module in between
    ("buffer", "def f():\n    from rlslurm.slurm.submit import submit\n", True),  # a node needs the login side
    ("rollout", "from rlslurm.engines.engine import EngineSpec\n", False),
    ("trainer", "from rlslurm.engines.fanout import Engines\n", False),
    ("trainer", "from rlslurm.job.env import job_env\n", False),
    ("rollout", "from rlslurm.resolve import resolve\n", True),          # the login side's checks
    ("trainer", "from rlslurm.settings.layout import check\n", False),  # settings: shared by both sides
    ("models", "from rlslurm.trainer.step import train_step\n", True),   # models/ is below the trainer
    ("models", "def f():\n    from rlslurm.convert import mapping\n", True),  # and below convert/
    ("models", "from rlslurm.tiny import hf_config_dict\n", True),       # tiny.py reads models/, not back
    ("models", "from rlslurm.settings.layout import check\n", False),
    ("trainer", "from rlslurm.models.build import build_gpt_model\n", False),
])
def test_the_check_sees_each_form(tmp_path, role, source, banned):
    for mod, text in ((f"{role}/mod.py", source), ("checks.py", "from rlslurm.rollout.rollout_fn import x\n"),
                      ("rollout/rollout_fn.py", ""), ("slurm/submit.py", ""), ("job/env.py", ""),
                      ("engines/fanout.py", ""), ("engines/engine.py", ""), ("resolve.py", ""),
                      ("settings/layout.py", ""), ("trainer/step.py", ""), ("convert/mapping.py", ""),
                      ("tiny.py", ""), ("models/build.py", "")):
        (tmp_path / mod).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / mod).write_text(text)
    found = [v for v in violations(tmp_path) if v.startswith(f"rlslurm/{role}/mod.py")]
    assert bool(found) == banned, found
