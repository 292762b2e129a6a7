"""The container definitions for the supported GPU stack (containers/): the Dockerfile and the
Apptainer definition build FROM the same public image and install through one script, which takes
every version from constraints/gpu-torch211.txt, so the image cannot drift from the stack the GPU tier
measured. (Building them needs a container runtime and the network, which the test machine lacks.)"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
C = ROOT / "containers"


def test_both_definitions_build_the_constrained_stack_from_one_public_image() -> None:
    docker = (C / "Dockerfile").read_text()
    apptainer = (C / "rlslurm-gpu.def").read_text()
    [base] = re.findall(r"^FROM (\S+)$", docker, re.M)
    assert re.search(rf"^Bootstrap: docker\nFrom: {re.escape(base)}$", apptainer, re.M), apptainer
    assert base.startswith("nvidia/cuda:") and "ubuntu24.04" in base  # public; Python 3.12, as measured
    assert "containers/install-gpu.sh /opt/rlslurm" in docker and "containers/install-gpu.sh /opt/rlslurm" in apptainer
    script = (C / "install-gpu.sh").read_text()
    assert subprocess.run(["bash", "-n", str(C / "install-gpu.sh")]).returncode == 0
    assert "constraints=constraints/gpu-torch211.txt" in script and '-c "$constraints"' in script
    assert not re.search(r"==\d", script), "a version pinned in the script instead of the constraints file"
    # the script's one version lookup finds the stack's torch
    pins = [l for l in (ROOT / "constraints/gpu-torch211.txt").read_text().splitlines() if re.match(r"^torch==", l)]
    assert len(pins) == 1, pins
