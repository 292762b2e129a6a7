"""--colocate's phases (rlslurm/trainer/colocate.py) against the real CPU SGLang engines of the shared
private deployment: the engines release and resume their memory (on CPU the release only flushes
their cache, docs/sglang-behaviour.md) and serve the same greedy tokens afterwards; the trainer's
tensors leave for host memory and come back bit for bit, views of a flat buffer and Adam's state
included, so a step after the round trip equals a step without it; the health-check bracket is
held for the whole window and renewed; an engine that does not answer fails the phase in bound, or
ends the step as EnginesGone when the job is ending; an engine the turn did not release is not
resumed (SGLang would die of it); an engine whose process goes away at the release is waited for
and the release done again (the trainer goes on)."""

from __future__ import annotations

import asyncio
import copy
import os
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from rlslurm.buffer.control import Control
from rlslurm.buffer.rundir import RunDir
from rlslurm.engines.sglang_client import SGLangClient
from rlslurm.engines.supervisor import control_publisher
from rlslurm.trainer.colocate import Colocation, EnginesGone

pytestmark = [pytest.mark.sglang]

PROMPT = [5, 17, 9, 33, 12, 40]


async def _greedy(dep) -> list[list[int]]:
    out = []
    for url in dep.supervisor.urls:
        async with SGLangClient(url, dep.api_key) as c:
            r = await c.generate(PROMPT, {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True})
            out.append(r["output_ids"])
    return out


class Flat(torch.nn.Module):
    """Two parameters that are views of one flat buffer, as megatron's DDP lays them out."""

    def __init__(self) -> None:
        super().__init__()
        self.flat = torch.randn(40)
        self.a = torch.nn.Parameter(self.flat[:24].view(4, 6))
        self.b = torch.nn.Parameter(self.flat[24:].view(16))


def _trainer_state() -> SimpleNamespace:
    torch.manual_seed(0)
    model = Flat()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    (model.a.sum() + (model.b ** 2).sum()).backward()
    opt.step()  # Adam's moments exist
    ref = torch.nn.Linear(3, 3)
    return SimpleNamespace(actor=SimpleNamespace(model=model, optimizer=opt), ref=ref, critic=None,
                           device=torch.device("cpu"))


def _step(st) -> None:
    st.actor.optimizer.zero_grad()
    (st.actor.model.a.sum() * 3 + st.actor.model.b.sum()).backward()
    getattr(st.actor, "before_step", lambda: None)()  # as trainer/step.py: the optimizer state is back first
    st.actor.optimizer.step()


@pytest.fixture
def one_rank():
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        from rlslurm.net import free_port

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_phases_move_the_engines_and_the_trainer_and_keep_both_exact(private_deployment, tmp_path: Path,
                                                                        one_rank) -> None:
    dep = private_deployment
    control = Control(RunDir.create(tmp_path / "run"))
    control_publisher(control, "node0")(dep.supervisor.engines())
    before = asyncio.run(_greedy(dep))

    st, twin = _trainer_state(), None
    twin = copy.deepcopy(st)
    colo = Colocation(st, control, dep.api_key, rank=0, timeout_s=20.0)
    assert colo.params.nbytes == 40 * 4  # one storage for both views
    colo.offload_all()
    assert st.actor.model.flat.untyped_storage().nbytes() == 0 and colo.rest.offloaded

    colo.to_trainer(1)
    bracket = control.weight_update()
    assert bracket is not None and bracket.version == 1 and bracket.until > time.time()
    assert torch.equal(st.actor.model.a, twin.actor.model.a) and torch.equal(st.ref.weight, twin.ref.weight)
    _step(st)
    _step(twin)
    assert torch.equal(st.actor.model.a, twin.actor.model.a)  # the step read the moments that came back
    colo.to_engines_for_weights()
    assert not colo.params.offloaded and colo.rest.offloaded and control.weight_update() is not None
    colo.to_engines()
    assert control.weight_update() is None  # the health checks may go on
    assert set(colo.times) == {"time/engines_release", "time/onload", "time/onload_wait", "time/offload",
                               "time/engines_resume"}
    assert all(v >= 0 for v in colo.times.values())
    assert asyncio.run(_greedy(dep)) == before  # released, resumed: the same weights serve

    with colo.holding():  # a checkpoint between phases sees every tensor
        assert torch.equal(st.actor.model.b, twin.actor.model.b)
        for p, q in zip(st.actor.model.parameters(), twin.actor.model.parameters()):
            assert torch.equal(st.actor.optimizer.state[p]["exp_avg_sq"], twin.actor.optimizer.state[q]["exp_avg_sq"])
    assert colo.params.offloaded and colo.rest.offloaded


def test_no_offload_train_keeps_the_trainer_in_place_and_the_engines_still_take_turns(
        private_deployment, tmp_path: Path, one_rank) -> None:
    """--no-offload-train: the same phases with the engines, and not one of the trainer's storages moves
    (the same storage objects, never resized to 0), so its tensors are the very ones the step updates."""
    dep = private_deployment
    control = Control(RunDir.create(tmp_path / "run"))
    control_publisher(control, "node0")(dep.supervisor.engines())
    st = _trainer_state()
    colo = Colocation(st, control, dep.api_key, rank=0, timeout_s=20.0, moves=())
    flat, moment = st.actor.model.flat, st.actor.optimizer.state[st.actor.model.a]["exp_avg"]
    ptrs = (flat.data_ptr(), moment.data_ptr())
    colo.offload_all()
    colo.to_trainer(1)
    assert control.weight_update() is not None  # the engines did release: the bracket holds their checks
    _step(st)
    colo.to_engines_for_weights()
    colo.to_engines()
    assert not (colo.params.offloaded or colo.grads.offloaded or colo.rest.offloaded)
    assert (flat.data_ptr(), moment.data_ptr()) == ptrs and flat.untyped_storage().nbytes() == 40 * 4
    assert control.weight_update() is None
    assert asyncio.run(_greedy(dep))  # the engines generate again
    colo.close()

def test_an_engine_that_does_not_answer_fails_the_phase_in_bound(tmp_path: Path, one_rank) -> None:
    """A peer that accepts the connection and never answers (a hung engine): the release fails within
    the phase's timeout, on every rank, and the step fails (SLURM then requeues the job)."""
    from rlslurm.buffer.control import EngineRecord

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        control = Control(RunDir.create(tmp_path / "run"))
        control.write_engines([EngineRecord(url=f"http://127.0.0.1:{silent.getsockname()[1]}", node="n0",
                                            healthy=True)])
        colo = Colocation(_trainer_state(), control, "key", rank=0, timeout_s=1.0)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"colocate: releasing the engines' memory failed: .*1(\.0)? s"):
            colo.to_trainer(1)
        assert time.monotonic() - t0 < 1.0 + 10.0
        colo.close()
        assert control.weight_update() is None
    finally:
        silent.close()


def test_an_engine_that_came_up_during_the_turn_is_not_resumed(private_deployment, tmp_path: Path,
                                                                 one_rank) -> None:
    """A requeued trainer's first turn began while the engine was still starting (found on an H200,
    tools/gpu/field-colocate.sh): the release reached no engine, then the resume reached one that had
    released nothing, and SGLang's `resume_memory_occupation` died of the KeyError. Only the engines
    the turn released (the same process) are resumed; the others are left as they are and serve on."""
    dep = private_deployment
    control = Control(RunDir.create(tmp_path / "run"))
    before = asyncio.run(_greedy(dep))
    colo = Colocation(_trainer_state(), control, dep.api_key, rank=0, timeout_s=20.0)
    colo.offload_all()
    colo.to_trainer(1)  # no engine listed yet: nothing released
    control_publisher(control, "node0")(dep.supervisor.engines())  # ... and now it is up
    colo.to_engines_for_weights()
    colo.to_engines()
    assert all(e.is_alive() for e in (dep.supervisor.process(e.name) for e in dep.supervisor.engines()))
    assert asyncio.run(_greedy(dep)) == before


def test_a_phase_that_fails_while_the_job_ends_is_engines_gone(tmp_path: Path, one_rank) -> None:
    """kill -9 of `rlslurm run` or a TERM to the whole job takes the engines down while the trainer is
    inside a turn (measured on an H200: the resume of the weights found no engine, the trainer exited
    without its checkpoint). With the job ending, the failure is EnginesGone: the trainer then saves."""
    from rlslurm.buffer.control import EngineRecord

    control = Control(RunDir.create(tmp_path / "run"))
    control.write_engines([EngineRecord(url="http://127.0.0.1:9", node="n0", healthy=True)])  # refuses
    ending = [False]
    colo = Colocation(_trainer_state(), control, "key", rank=0, timeout_s=2.0, ending=lambda: ending[0])
    with pytest.raises(RuntimeError) as e:
        colo.to_trainer(1)
    assert type(e.value) is RuntimeError  # not ending: a failure, SLURM requeues
    ending[0] = True
    with pytest.raises(EnginesGone, match="colocate: releasing the engines' memory failed"):
        colo.to_trainer(2)
    colo.close()



def test_an_engine_that_goes_away_at_the_release_is_waited_for_and_released_again(
        private_deployment, tmp_path: Path, one_rank, caplog) -> None:
    """An engine's process ends as the turn begins (found in the SLURM span test: kill -9 of another
    node's rank took the engine down at /pause_generation, and the trainer exited). Its connection
    drops and its port then refuses: the turn lets the bracket go (so its supervisor may restart it),
    waits until the engines are up again, and releases those; the trainer goes on."""
    import threading

    from rlslurm.buffer.control import EngineRecord

    dep = private_deployment
    dying = socket.socket()  # the engine's last moments: takes the request, drops it, is gone
    dying.bind(("127.0.0.1", 0))
    dying.listen(8)
    url = f"http://127.0.0.1:{dying.getsockname()[1]}"

    def die() -> None:
        conn, _ = dying.accept()
        conn.close()
        dying.close()
    dead = threading.Thread(target=die, daemon=True)
    dead.start()

    control = Control(RunDir.create(tmp_path / "run"))
    control.write_engines([EngineRecord(url=url, node="n0", pid=1, healthy=True)])
    before = asyncio.run(_greedy(dep))
    colo = Colocation(_trainer_state(), control, dep.api_key, rank=0, timeout_s=60.0)
    colo.offload_all()
    waited = []

    def restarted() -> None:  # its supervisor, once the bracket is let go: a new process is up
        dead.join(timeout=60)  # the turn's request reached it inside the bracket
        deadline = time.monotonic() + 60
        while control.weight_update() is not None and time.monotonic() < deadline:
            time.sleep(0.02)
        waited.append(not dead.is_alive() and control.weight_update() is None)
        control_publisher(control, "n0")(dep.supervisor.engines())
    helper = threading.Thread(target=restarted, daemon=True)
    helper.start()
    with caplog.at_level("WARNING", logger="rlslurm.trainer.colocate"):
        colo.to_trainer(1)
    helper.join(timeout=5)
    assert waited == [True]  # the bracket was let go while it waited
    assert f"release 1 of 3: {url} went away" in caplog.text
    assert colo._released == {(t.url, t.pid) for t in dep.supervisor.engines()}  # the new ones released
    colo.to_engines_for_weights()
    colo.to_engines()
    assert control.weight_update() is None
    assert asyncio.run(_greedy(dep)) == before
    colo.close()
