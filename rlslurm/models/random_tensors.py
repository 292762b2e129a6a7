"""Random tensors appended to a written checkpoint: the parts of a release that transformers' model
class does not build (MTP layers), so tests see what rlslurm does with tensors it has no rule for.
Used by the families' `checkpoint_extras` (models/family.py) when rlslurm/tiny.py writes a demo
checkpoint; torch is imported only when called."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def add_random_tensors(out: Path, shapes: dict[str, tuple[int, ...]], dtype: Any, seed: int) -> None:
    """Add `shapes` (name -> shape), drawn N(0, 0.02) from `seed` + 1, to OUT/model.safetensors."""
    import torch
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(seed + 1)
    path = out / "model.safetensors"
    tensors = load_file(path)
    for name, shape in shapes.items():
        tensors[name] = (torch.randn(*shape, generator=g) * 0.02).to(dtype)
    save_file(tensors, path, metadata={"format": "pt"})
