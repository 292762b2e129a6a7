"""A colocated turn's optimizer state comes back beside the first forward/backward (trainer/tensor_sets.py
LateCopy, trainer/colocate.py `to_trainer`), on a GPU: from pinned host memory on a stream of its own,
while the default stream runs a forward and backward; the optimizer step that waits for it first
(`finish_onload`) gives the weights of an optimizer that never left the GPU, bit for bit. The CPU tier
checks the bookkeeping (tests/trainer/test_colocate_tensors.py); only a GPU has the second stream."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch

from rlslurm.trainer.tensor_sets import optimizer_state, other_tensors
from tests.helpers.colocation import bare_colocation


def _trainer(dev: torch.device) -> SimpleNamespace:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(4096, 4096) for _ in range(8))).to(dev)
    return SimpleNamespace(actor=SimpleNamespace(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3)),
                           ref=None, critic=None)


def _backward(st, x: torch.Tensor) -> None:
    st.actor.optimizer.zero_grad(set_to_none=True)
    for _ in range(4):  # long enough that the copy is still under way when it starts
        st.actor.model(x).float().square().mean().backward()


def test_the_optimizer_state_copied_beside_the_backward_steps_exactly() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())  # the sets compare devices with the index
    st = _trainer(dev)
    x = torch.randn(4096, 4096, device=dev)
    _backward(st, x)
    st.actor.optimizer.step()  # Adam's moments exist: 2 x 512 MiB beside the params
    twin = copy.deepcopy(st)
    colo = bare_colocation(st, dev, ("rest",))
    colo.rest.add(other_tensors(st), exclude=(colo.params, colo.grads), late=optimizer_state(st))
    assert colo.rest.nbytes >= 2**30 and all(s.late for s in colo.rest.stored)

    colo._move(offload=(colo.rest,))
    assert all(s.host is not None and s.host.is_pinned() for s in colo.rest.stored)
    colo._move(onload=(colo.rest,), defer_late=True)
    assert colo._late is not None and colo._late._done is not None  # on its own stream, under way
    _backward(st, x)
    colo.finish_onload()
    st.actor.optimizer.step()
    _backward(twin, x)
    twin.actor.optimizer.step()
    for p, q in zip(st.actor.model.parameters(), twin.actor.model.parameters()):
        assert torch.equal(p, q)
    print(f"late copy of {colo.rest.nbytes / 2**30:.2f} GiB beside a backward: the step waited "
          f"{colo.times['time/onload_wait']:.3f} s for it; weights equal to the resident optimizer's")


def test_copies_past_the_pin_budget_stay_pageable_and_the_step_is_exact() -> None:
    """Where the host has room for only part of the copies (trainer/host_memory.py copies_pin_budget), the
    storages past the budget get pageable host copies; their late copy is synchronous, and exact."""
    dev = torch.device("cuda", torch.cuda.current_device())
    st = _trainer(dev)
    x = torch.randn(4096, 4096, device=dev)
    _backward(st, x)
    st.actor.optimizer.step()
    twin = copy.deepcopy(st)
    colo = bare_colocation(st, dev, ("rest",))
    colo.rest.add(other_tensors(st), exclude=(colo.params, colo.grads), late=optimizer_state(st))
    colo.pin_within(colo.rest.nbytes // 2)
    colo._move(offload=(colo.rest,))
    pinned = [s.host.is_pinned() for s in colo.rest.stored]
    assert any(pinned) and not all(pinned)
    assert sum(s.nbytes for s, p in zip(colo.rest.stored, pinned) if p) <= colo.rest.nbytes // 2
    colo._move(onload=(colo.rest,), defer_late=True)
    _backward(st, x)
    colo.finish_onload()
    st.actor.optimizer.step()
    _backward(twin, x)
    twin.actor.optimizer.step()
    for p, q in zip(st.actor.model.parameters(), twin.actor.model.parameters()):
        assert torch.equal(p, q)
