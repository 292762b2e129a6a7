"""`rlslurm --version` and `rlslurm doctor` (issue 48): the installed torch, megatron-core, SGLang,
sglang-router, transformers and transformer-engine, whether they are a supported stack (rlslurm/stacks.py),
and what the machine has (docs/supported-stacks.md)."""

from __future__ import annotations

import json
import re

from tests.helpers.cli_proc import run


def test_version_and_doctor_name_this_environments_stack() -> None:
    """CI's environment is the cpu stack (tools/install.sh installs constraints/cpu.txt)."""
    import importlib.metadata as md

    p = run("-m", "rlslurm", "--version")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith("rlslurm ") and f"torch {md.version('torch')}" in lines
    assert f"megatron-core {md.version('megatron-core')}" in lines and "transformer-engine not installed" in lines
    assert lines[-1] == ("stack: cpu (constraints/cpu.txt; measured: CPU: CI, the test suite and the demo (fresh "
                         "Debian 12, no GPU))")
    d = run("-m", "rlslurm", "doctor", "--json")
    assert d.returncode == 0, d.stderr
    facts = json.loads(d.stdout)
    assert facts["stack"] == {"supported": True, "stack": "cpu", "constraints": "constraints/cpu.txt", "why": None}
    assert facts["versions"]["sglang"] == md.version("sglang") and facts["torch_imports"] is True
    assert facts["torch_memory_saver"]["installed"] is False  # the CPU stack has none: --colocate on GPUs needs it
    from rlslurm.doctor import doctor_lines

    text = doctor_lines(facts)  # what `rlslurm doctor` prints of the same facts
    assert any(re.fullmatch(r"gpus: \d+ \(from (nvidia-smi|torch)\)", line) for line in text), text
    assert "torch_memory_saver: not installed (--colocate on GPUs needs it)" in text
