"""--colocate's tensor moves (rlslurm/trainer/colocate.py) without engines: state the trainer makes after
the sets were taken (Adam's moments appear at the first step) moves too once added, and a storage
already in a set is recognised after it has been moved (its address changes, its identity does not)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch

from rlslurm.trainer.colocate import TensorSet, other_tensors


def _state() -> SimpleNamespace:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    return SimpleNamespace(actor=SimpleNamespace(model=model, optimizer=opt), ref=None, critic=None)


def _step(st) -> None:
    st.actor.optimizer.zero_grad()
    st.actor.model(torch.ones(3, 8)).square().sum().backward()
    st.actor.optimizer.step()


def test_state_made_after_the_sets_moves_once_added() -> None:
    st = _state()
    dev = torch.device("cpu")
    params = TensorSet.of((p.data for p in st.actor.model.parameters()), dev)
    rest = TensorSet.of(other_tensors(st), dev, exclude=params)
    assert rest.nbytes == 0  # no grads, no moments yet

    _step(st)
    twin = copy.deepcopy(st)
    moments = [v for s in st.actor.optimizer.state.values() for v in s.values()]  # and the step counts
    added = rest.add(other_tensors(st), exclude=params)
    assert added == sum(t.untyped_storage().nbytes() for t in moments) + sum(
        p.grad.untyped_storage().nbytes() for p in st.actor.model.parameters())
    rest.offload()
    assert all(t.untyped_storage().nbytes() == 0 for t in moments)
    assert rest.add(other_tensors(st), exclude=params) == 0  # moved away: still known
    rest.onload()
    assert rest.add(other_tensors(st), exclude=params) == 0  # moved back, new address: still known
    _step(st)
    _step(twin)
    for p, q in zip(st.actor.model.parameters(), twin.actor.model.parameters()):
        assert torch.equal(p, q)  # the moments came back exact: the next step is the same
