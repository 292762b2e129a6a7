"""What this Python environment and this machine are, against the supported stacks (rlslurm/stacks.py):
`rlslurm --version` (the installed stack, from package metadata: fast, no torch needed) and `rlslurm
doctor`, run on a node (that plus what the node has: GPUs, CUDA, torch_memory_saver, transformer-engine).
One line per fact; `doctor --json` is the same facts as one object (docs/supported-stacks.md).
"""

from __future__ import annotations

import importlib.util
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from rlslurm import stacks


def _stack_facts() -> dict[str, Any]:
    found = stacks.installed()
    whole = stacks.judge(stacks.needs("node"), found, stacks.PRESENT)
    roles = {role: stacks.judge(stacks.needs(role), found, stacks.PRESENT) for role in ("trainer", "rollout")}
    return {"versions": found, "te_used": stacks.trainer_uses_te(), "node": whole, "roles": roles}


def _verdict_json(v: stacks.Verdict) -> dict[str, Any]:
    return {"supported": v.supported, "stack": v.stack.name if v.stack else None,
            "constraints": v.stack.constraints if v.stack else None, "why": v.why or None}


def _verdict_line(v: stacks.Verdict) -> str:
    if v.stack is not None:
        return f"{v.stack.name} ({v.stack.constraints}; measured: {v.stack.measured})"
    return f"not supported: {v.why} ({stacks.DOC})"


def version_lines() -> list[str]:
    """`rlslurm --version`: rlslurm, its Python, each component's version, whether they are a supported stack."""
    import rlslurm

    facts = _stack_facts()
    lines = [f"rlslurm {rlslurm.__version__} ({Path(rlslurm.__file__).parent}; "
             f"Python {platform.python_version()} at {sys.executable})"]
    for name, version in facts["versions"].items():
        used = (" (used only with --transformer-impl transformer_engine)"
                if name == "transformer-engine" and version else "")
        lines.append(f"{name} {version or 'not installed'}{used}")
    node: stacks.Verdict = facts["node"]
    if all(facts["versions"][c] is None for c in node.components):
        lines.append("stack: none installed (enough to submit jobs that run another Python environment: --python, "
                     "--container-image, --apptainer-image)")
        return lines
    lines.append(f"stack: {_verdict_line(node)}")
    if not node.supported:  # which half is one, if either
        lines += [f"{role} stack: {_verdict_line(v)}" for role, v in facts["roles"].items()]
    return lines


# ------------------------------------------------------------------------------------ the node


def _nvidia_smi_gpus() -> list[dict[str, Any]] | None:
    """Every GPU nvidia-smi lists (index, name, memory, driver); None without a working nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30,
                             check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    gpus = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4 and parts[0].isdigit():
            memory = int(parts[2]) if parts[2].isdigit() else None
            gpus.append({"index": int(parts[0]), "name": parts[1], "memory_mib": memory, "driver": parts[3]})
    return gpus


def _torch_facts() -> dict[str, Any]:
    """torch's CUDA build and the GPUs it sees (None where torch is missing or fails to import)."""
    try:
        import torch
    except Exception as e:  # a broken install says so in its line, not in a traceback
        return {"imports": False, "error": None if isinstance(e, ModuleNotFoundError) else f"{type(e).__name__}: {e}"}
    facts: dict[str, Any] = {"imports": True, "cuda": torch.version.cuda, "gpus": []}
    try:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            facts["gpus"].append({"index": i, "name": p.name, "memory_mib": p.total_memory // 2**20})
    except Exception as e:
        facts["error"] = f"{type(e).__name__}: {e}"
    return facts


def _import_check(module: str) -> dict[str, Any]:
    if importlib.util.find_spec(module) is None:
        return {"installed": False, "imports": False}
    try:
        importlib.import_module(module)
    except Exception as e:
        return {"installed": True, "imports": False, "error": f"{type(e).__name__}: {e}"}
    return {"installed": True, "imports": True}


def doctor_facts() -> dict[str, Any]:
    import rlslurm

    facts = _stack_facts()
    smi = _nvidia_smi_gpus()
    t = _torch_facts()
    gpus = smi if smi is not None else t.get("gpus", [])
    return {
        "rlslurm": rlslurm.__version__, "python": platform.python_version(), "executable": sys.executable,
        "versions": facts["versions"], "transformer_engine_used": facts["te_used"],
        "stack": _verdict_json(facts["node"]),
        "roles": {role: _verdict_json(v) for role, v in facts["roles"].items()},
        "gpus": gpus, "gpus_from": "nvidia-smi" if smi is not None else ("torch" if t["imports"] else None),
        "driver": gpus[0].get("driver") if smi else None,
        "torch_cuda": t.get("cuda"), "torch_imports": t["imports"], "torch_error": t.get("error"),
        "torch_memory_saver": _import_check("torch_memory_saver"),
        "transformer_engine": _import_check("transformer_engine") if facts["versions"]["transformer-engine"] else
        {"installed": False, "imports": False},
    }


def _import_line(what: dict[str, Any]) -> str:
    if not what["installed"]:
        return "not installed"
    return "imports" if what["imports"] else f"installed, fails to import: {what.get('error')}"


def doctor_lines(facts: dict[str, Any]) -> list[str]:
    lines = version_lines()
    gpus = facts["gpus"]
    where = f" (from {facts['gpus_from']})" if facts["gpus_from"] else " (no nvidia-smi, no torch)"
    lines.append(f"gpus: {len(gpus)}{where}")
    lines += [f"gpu {g['index']}: {g['name']}, {g['memory_mib']} MiB" for g in gpus]
    if facts["driver"]:
        lines.append(f"nvidia driver: {facts['driver']}")
    if facts["torch_imports"]:
        lines.append(f"torch cuda: {facts['torch_cuda'] or 'none (a CPU build)'}")
    elif facts["torch_error"]:
        lines.append(f"torch: fails to import: {facts['torch_error']}")
    lines.append(f"torch_memory_saver: {_import_line(facts['torch_memory_saver'])} (--colocate on GPUs needs it)")
    te = facts["transformer_engine"]
    lines.append(f"transformer-engine: {_import_line(te)}"
                 + (" (the trainer would use it)" if te["installed"] and facts["transformer_engine_used"] else ""))
    return lines
