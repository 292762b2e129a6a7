"""RUN/run.yaml: the resolved config, written once at submit, read by every process."""

from __future__ import annotations

from pathlib import Path

import yaml

from rlslurm.errors import ConfigError
from rlslurm.settings.config import RunConfig


def dump_run_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, allow_unicode=True, width=1000)


def load_run_config(run_dir: Path) -> RunConfig:
    path = Path(run_dir) / "run.yaml"
    if not path.exists():
        raise ConfigError(f"{path} does not exist: not a run directory")
    return RunConfig.model_validate(yaml.safe_load(path.read_text()))
