"""An invented stand-in for transformer-engine, shared by the --transformer-impl tests."""

from __future__ import annotations

from pathlib import Path


def fake_transformer_engine(root: Path, version: str) -> Path:
    """An invented stand-in, not transformer-engine: a `transformer_engine` package with the distribution
    metadata of `version` (what rlslurm reads of it at submit) that is installed but does not import (as a
    transformer-engine built for another CUDA or torch), under `root`."""
    (root / "transformer_engine").mkdir(parents=True)
    (root / "transformer_engine" / "__init__.py").write_text(
        'raise ModuleNotFoundError("an invented stand-in of transformer-engine that does not import")\n')
    dist = root / f"transformer_engine-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: transformer-engine\nVersion: {version}\n")
    return root
