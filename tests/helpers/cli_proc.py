"""The rlslurm command (or a role's module) as a user runs it: a fresh interpreter on the checkout, output
into pipes; `env_extra` adds variables, its PYTHONPATH goes ahead of the checkout's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, env_extra: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(filter(None, [(env_extra or {}).get("PYTHONPATH"), str(ROOT)]))
    env = {**os.environ, "COLUMNS": "200", **(env_extra or {}), "PYTHONPATH": path}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, env=env, cwd=cwd)
