"""trainer/colocate.py's Colocation over a trainer state without engines, for the tests of its moves
(tests/trainer/test_colocate_tensors.py on CPU, tests/gpu/test_late_onload.py on a GPU): its tensor sets
taken from `st` on `device`, the sets in `moves` moving, no engine, control or process group."""

from __future__ import annotations

from typing import Any

import torch

from rlslurm.trainer.colocate import Colocation
from rlslurm.trainer.tensor_sets import trainer_tensor_sets


def bare_colocation(st: Any, device: torch.device, moves: tuple[str, ...]) -> Colocation:
    st.device = device
    colo = Colocation.__new__(Colocation)
    colo.st, colo.cuda, colo.times, colo._late = st, device.type == "cuda", {}, None
    colo.params, colo.grads, colo.rest = trainer_tensor_sets(st, device)
    colo.sets = {"params": colo.params, "grads": colo.grads, "rest": colo.rest}
    colo.moves = moves
    return colo
