"""User docs speak to users (issue 46): no text about the machines or sessions this repository is
developed with ("the workplace's GPU machines", the device tool, a lease) in the README, pyproject.toml
or the docs docs/README.md lists for running rlslurm; those notes belong to the docs it lists under
"This repository"."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEVELOPERS_ONLY = re.compile(r"workplace|device tool|device call|(?<![\w-])lease[ds]?\b|\bthe lead\b|\bhelper session",
                             re.I)


def user_docs() -> list[Path]:
    index = (ROOT / "docs" / "README.md").read_text()
    users = index.split("## This repository")[0]
    names = re.findall(r"\]\(([\w.-]+\.md)\)", users)
    assert {"prompt-data.md", "sglang-versions.md", "low-precision.md"} <= set(names), names
    return [ROOT / "README.md", ROOT / "pyproject.toml", *(ROOT / "docs" / n for n in names)]


def test_user_docs_say_nothing_of_our_machines() -> None:
    found = [f"{p.relative_to(ROOT)}:{i}: {l.strip()[:120]}" for p in user_docs()
             for i, l in enumerate(p.read_text().splitlines(), 1) if DEVELOPERS_ONLY.search(l)]
    assert not found, "\n".join(found)
