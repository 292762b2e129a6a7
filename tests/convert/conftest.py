"""Fixtures for tests/convert: tiny random-init HF checkpoints of every mapped family, and one 2-process
torchrun for the modules that need one."""

from __future__ import annotations

from pathlib import Path

import pytest
from convert_helpers import FAMILIES


@pytest.fixture(scope="session")
def tiny_ckpts(tmp_path_factory) -> Path:
    """`<root>/<model>`: an HF checkpoint written by rlslurm.tiny for each family (fp32)."""
    from rlslurm.settings.model_config import load_model_config
    from rlslurm.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny_hf")
    for name in FAMILIES:
        make_tiny_checkpoint(load_model_config(name), root / name)
    return root


@pytest.fixture(scope="session")
def two_rank_runs(request: pytest.FixtureRequest, tmp_path_factory) -> dict[str, Path]:
    """The 2-process work of every module of this session that declares some, in one torchrun
    (tests/convert/chain_worker.py: a torchrun start costs ~20 s of imports on 2 cores). A module
    declares it with a module-level function

        two_rank_run(request, tmp) -> [WORKER.py, ARGS...]

    (a worker of this directory, run from the repository root; `tmp` is the module's own directory)
    and reads its `tmp` as `two_rank_runs[module.__name__]` once the run is done. Only the modules of
    the tests selected in this session run theirs."""
    from convert_helpers import check, run_procs

    modules = []
    for item in request.session.items:
        mod = getattr(item, "module", None)
        if mod is not None and callable(getattr(mod, "two_rank_run", None)) and mod not in modules:
            modules.append(mod)
    dirs = {mod.__name__: tmp_path_factory.mktemp(mod.__name__) for mod in modules}
    chain = [mod.two_rank_run(request, dirs[mod.__name__]) for mod in modules]
    if len(chain) == 1:
        check(run_procs(2, chain[0], timeout=600))
    elif chain:
        args = ["tests/convert/chain_worker.py"]
        for i, argv in enumerate(chain):
            args += ["--", *argv] if i else argv
        check(run_procs(2, args, timeout=600 * len(chain)))
    return dirs
