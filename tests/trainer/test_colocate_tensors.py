"""--colocate's tensor moves (rlslurm/trainer/tensor_sets.py) without engines: state the trainer makes after
the sets were taken (Adam's moments appear at the first step) moves too once added, a storage already
in a set is recognised after it has been moved (its address changes, its identity does not), and the
gradient buffer (megatron's `main_grad` views, zeroed before every step's backward) is dropped on the
offload and comes back as zeros: nothing of it is copied either way."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch

from rlslurm.trainer.tensor_sets import grad_tensors, optimizer_state, other_tensors, trainer_tensor_sets
from tests.helpers.colocation import bare_colocation


def _state() -> SimpleNamespace:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    return _attach(SimpleNamespace(actor=SimpleNamespace(model=model, optimizer=opt), ref=None, critic=None))


def _attach(st) -> SimpleNamespace:
    """megatron's layout: every param's main_grad is a view of one flat gradient buffer."""
    params = list(st.actor.model.parameters())
    st.buf = getattr(st, "buf", None)
    if st.buf is None:
        st.buf = torch.zeros(sum(p.numel() for p in params))
    at = 0
    for p in params:
        p.main_grad = st.buf[at:at + p.numel()].view_as(p)
        at += p.numel()
    return st


def _copy(st) -> SimpleNamespace:
    return _attach(copy.deepcopy(st))  # a Parameter's deepcopy leaves its main_grad behind


def _step(st) -> None:
    """As trainer/step.py: the gradient buffer zeroed first, then backward into it, then the optimizer."""
    params = list(st.actor.model.parameters())
    for p in params:
        p.main_grad.zero_()
    st.actor.model(torch.ones(3, 8)).square().sum().backward()
    for p in params:
        p.main_grad.add_(p.grad)
        p.grad = p.main_grad  # the optimizer reads the buffer, as megatron's does
    st.actor.optimizer.step()
    for p in params:
        p.grad = None


def test_state_made_after_the_sets_moves_once_added() -> None:
    st = _state()
    dev = torch.device("cpu")
    params, grads, rest = trainer_tensor_sets(st, dev)
    assert rest.nbytes == 0  # no moments yet
    assert grads.nbytes == st.buf.untyped_storage().nbytes() and grads.scratch

    _step(st)
    twin = _copy(st)
    moments = [v for s in st.actor.optimizer.state.values() for v in s.values()]  # and the step counts
    added = rest.add(other_tensors(st), exclude=(params, grads))
    assert added == sum(t.untyped_storage().nbytes() for t in moments)
    assert grads.add(grad_tensors(st), exclude=(params, rest)) == 0
    rest.offload()
    assert all(t.untyped_storage().nbytes() == 0 for t in moments)
    assert rest.add(other_tensors(st), exclude=(params, grads)) == 0  # moved away: still known
    rest.onload()
    assert rest.add(other_tensors(st), exclude=(params, grads)) == 0  # moved back, new address: still known
    _step(st)
    _step(twin)
    for p, q in zip(st.actor.model.parameters(), twin.actor.model.parameters()):
        assert torch.equal(p, q)  # the moments came back exact: the next step is the same


def test_a_rest_that_moves_in_part_keeps_what_fits_in_order_and_the_step_is_the_same() -> None:
    """offload-train auto moves of the rest (optimizer state) only what does not fit beside the engines
    (`TensorSet.keep`): its storages stay in order while they fit, Adam's moments made after the decision
    included; a smaller keep (the re-check) moves the last that stayed; onloaded, the next step is the same."""
    st = _state()
    dev = torch.device("cpu")
    params, grads, rest = trainer_tensor_sets(st, dev)
    _step(st)  # the moments appear after the decision, as at the first step
    rest.add(other_tensors(st), exclude=(params, grads))
    twin = _copy(st)
    sizes = [s.nbytes for s in rest.stored]
    assert len(sizes) >= 4
    rest.keep = sizes[0] + sizes[1] + sizes[2] - 1  # the first two fit, the third does not
    rest.offload()
    on = [s.storage.nbytes() > 0 for s in rest.stored]
    assert on[:3] == [True, True, False] and rest.device_nbytes == sum(n for n, o in zip(sizes, on) if o)
    assert rest.device_nbytes <= rest.keep
    rest.keep = sizes[0] + sizes[1] - 1  # shrunk: the second goes too, the first stays
    rest.offload()
    assert [s.storage.nbytes() > 0 for s in rest.stored][:2] == [True, False]
    rest.onload()
    assert rest.device_nbytes == rest.nbytes
    _step(st)
    _step(twin)
    for p, q in zip(st.actor.model.parameters(), twin.actor.model.parameters()):
        assert torch.equal(p, q)


def test_gradients_are_dropped_not_copied_and_the_next_step_is_the_same() -> None:
    st = _state()
    params, grads, rest = trainer_tensor_sets(st, torch.device("cpu"))
    _step(st)
    rest.add(other_tensors(st), exclude=(params, grads))
    twin = _copy(st)
    assert st.buf.abs().sum() > 0  # the last step's gradients are in the buffer

    for s in (rest, grads, params):
        s.offload()
    assert st.buf.untyped_storage().nbytes() == 0
    assert all(x.host is None for x in grads.stored)  # no host copy was made of the gradients
    assert all(x.host is not None for x in (*rest.stored, *params.stored))
    for s in (params, grads, rest):
        s.onload()
    assert torch.count_nonzero(st.buf) == 0 and st.buf.untyped_storage().nbytes() == grads.nbytes
    _step(st)
    _step(twin)
    for p, q in zip(st.actor.model.parameters(), twin.actor.model.parameters()):
        assert torch.equal(p, q)  # every step zeroes the buffer first: its old contents were dead


def test_the_runs_offload_train_setting_reaches_the_colocation(tmp_path) -> None:
    """`--offload-train` (run.offload_train True) moves the trainer's tensors to host memory before the
    first rollout, `--no-offload-train` (False) keeps every tensor where it is; unset, the trainer decides
    (trainer/offload_choice.py), and on --device cpu, with no GPU memory to share, it keeps everything.
    The record that lets the engines start is written after that, and says what moved and why."""
    import torch.distributed as dist

    from rlslurm.buffer.control import Control
    from rlslurm.buffer.rundir import RunDir
    from rlslurm.trainer.turns import ColocatedTurn

    ours = not dist.is_initialized()
    if ours:  # the record is gathered from every rank (here one)
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    for setting, moved, said in ((None, False, "auto"), (True, True, "--offload-train"),
                                 (False, False, "--no-offload-train")):
        st = _state()
        _step(st)
        st.device = torch.device("cpu")
        rd = RunDir.create(tmp_path / f"run-{setting}")
        trainer = SimpleNamespace(st=st, rd=rd, control=Control(rd), rank=0, attempt=3, pin_host=True,
                                  plan=SimpleNamespace(timeout_s=5.0, bucket_bytes=2**20),
                                  attempt_ending=lambda: False, delivery=SimpleNamespace(pending=None),
                                  cfg=SimpleNamespace(run=SimpleNamespace(offload_train=setting)))
        turn = ColocatedTurn.start(trainer)
        try:
            weight = st.actor.model[0].weight
            assert bool(turn.colo.moves) is moved and (weight.untyped_storage().nbytes() == 0) is moved, setting
            # only then may the engines start (engines/memory_share.py): the record of this attempt
            rec = Control(rd).colocation_memory(3)
            assert rec is not None and Control(rd).colocation_memory(2) is None
            assert rec.offload is not None and rec.offload.setting == said, rec
            assert rec.offload.moves == (["params", "grads", "rest"] if moved else []), rec.offload
            assert rec.offload.keeps == ([] if moved else ["params", "grads", "rest"]), rec.offload
            if setting is None:
                assert "moves nothing (--device cpu: no GPU memory" in rec.offload.line, rec.offload.line
        finally:
            turn.close()
    if ours:
        dist.destroy_process_group()


def test_the_actors_buffers_stay_with_its_params_for_the_export() -> None:
    """The export reads the actor's buffers (megatron's router `expert_bias`) after the rest has moved off
    the GPU for the engines' weights (Colocation.to_engines_for_weights); before, a buffer moved with the
    rest and the first publish of an MoE model with a router bias read a freed storage."""
    st = _state()
    st.actor.model[1].register_buffer("expert_bias", torch.arange(2.0))
    params, grads, rest = trainer_tensor_sets(st, torch.device("cpu"))
    rest.offload()
    rest.add(other_tensors(st), exclude=(params, grads))
    rest.offload()
    kept = st.actor.model[1].expert_bias.untyped_storage().nbytes()  # a number: a freed tensor's repr would crash
    assert kept > 0
    assert torch.equal(st.actor.model[1].expert_bias, torch.arange(2.0))
    params.offload()
    assert st.actor.model[1].expert_bias.untyped_storage().nbytes() == 0  # it moves with the params
    params.onload()
    assert torch.equal(st.actor.model[1].expert_bias, torch.arange(2.0))


def test_a_turn_that_ends_holding_more_than_its_room_moves_more_and_records_it(tmp_path, monkeypatch) -> None:
    """offload-train auto's re-check at a turn's end (trainer/colocate.py `Colocation._recheck`), on CPU with
    the GPU's reserved memory given: a trainer that kept everything and now holds 16 bytes more than the room
    the engines left it drops its gradients (no copy) before they resume; still over at the next turn's end,
    it moves as much of its optimizer state as it is over; control/colocate_memory.json says what it moves
    and why each time.
    Within its room, nothing moves."""
    from rlslurm.buffer.control import ColocationMemory, Control, OffloadRecord
    from rlslurm.trainer import colocate

    st = _state()
    _step(st)
    control = Control(tmp_path / "run")
    control.write_colocation_memory(ColocationMemory(attempt=2, margins={"": 0}, offload=OffloadRecord(
        setting="auto", keeps=["params", "grads", "rest"], moves=[], line="keeps everything")))
    colo = bare_colocation(st, torch.device("cpu"), ())
    colo.control, colo.rank = control, 0
    colo._room, colo._attempt = 10 * 2**20, 2
    held = [colo._room]
    monkeypatch.setattr(colocate.torch.cuda, "memory_reserved", lambda device=None: held[0])
    monkeypatch.setattr(colocate.dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(colocate.dist, "all_gather_object", lambda out, obj, group=None: out.__setitem__(0, obj))

    colo._recheck()
    assert colo.moves == () and not colo.rest.offloaded
    held[0] += 16  # less than the gradients here: they alone will do
    colo._recheck()
    assert colo.moves == ("grads",) and colo.grads.offloaded and not colo.rest.offloaded and not colo.params.offloaded
    off = control.colocation_memory(2).offload
    assert (off.keeps, off.moves, off.line) == (["params", "rest"], ["grads"], "keeps everything")
    line = "the trainer holds 0.01 GiB beside the engines, 0.00 GiB more than the 0.01 GiB they left it: now moves"
    assert off.rechecks == [f"{line} grads too (keeps params, optimizer state)"]
    rest = colo.rest.nbytes
    colo._recheck()  # (the reserved memory given stays 16 bytes over): that much of the optimizer state goes too
    assert colo.moves == ("grads", "rest") and colo.rest.keep == rest - 16 and not colo.params.offloaded
    assert colo.rest.offloaded and 0 < colo.rest.device_nbytes <= rest - 16  # the last storages, not all
    off = control.colocation_memory(2).offload
    assert (off.keeps, off.moves, off.rest_kept_gib) == (["params"], ["grads", "rest"], round((rest - 16) / 2**30, 3))
    assert off.rechecks[1:] == [f"{line} optimizer state beyond 0.00 GiB too (keeps params, 0.00 GiB of "
                                "optimizer state)"]
    assert colo.times["mem/trainer_held_gib"] > colo.times["mem/trainer_room_gib"]


def test_the_optimizer_state_comes_back_late_and_the_step_waits_for_it() -> None:
    """A turn's onload (`Colocation.to_trainer`) copies the optimizer state back beside the first
    forward/backward (on a GPU on a stream of its own; on a CPU the copies wait for `finish_onload`): every
    optimizer tensor, and only those, is marked late, the storages are allocated at once, and what the
    step then reads is exact."""
    st = _state()
    _step(st)  # Adam's moments exist
    colo = bare_colocation(st, torch.device("cpu"), ("grads", "rest"))
    colo.rest.add(other_tensors(st), exclude=(colo.params, colo.grads), late=optimizer_state(st))
    twin = _copy(st)
    late = {s.storage._cdata for s in colo.rest.stored if s.late}
    assert late and late == {t.untyped_storage()._cdata for t in optimizer_state(st)
                             if t.untyped_storage()._cdata in {s.storage._cdata for s in colo.rest.stored}}
    colo._move(offload=(colo.rest, colo.grads))
    colo._move(onload=(colo.params, colo.grads, colo.rest), defer_late=True)
    assert colo._late is not None and colo._late.nbytes == sum(s.nbytes for s in colo.rest.stored if s.late)
    assert colo.rest.device_nbytes == colo.rest.nbytes  # allocated now, filled by finish_onload
    colo.finish_onload()  # as the optimizer step does first (Trained.before_step, trainer/step.py)
    assert colo._late is None and colo.times["time/onload_wait"] >= 0
    _step(st)
    _step(twin)
    for p, q in zip(st.actor.model.parameters(), twin.actor.model.parameters()):
        assert torch.equal(p, q)


def test_a_move_while_the_late_copy_is_under_way_waits_for_it_first() -> None:
    """An offload right after a deferred onload (a save's or a job end's move before any step) copies the
    optimizer state, not the storages' contents before their copy back landed."""
    st = _state()
    _step(st)
    colo = bare_colocation(st, torch.device("cpu"), ("rest",))
    colo.rest.add(other_tensors(st), exclude=(colo.params, colo.grads), late=optimizer_state(st))
    twin = _copy(st)
    colo._move(offload=(colo.rest,))
    colo._move(onload=(colo.rest,), defer_late=True)
    colo._move(offload=(colo.rest,))  # no step between: nothing waited for the late copy yet
    assert colo._late is None
    colo._move(onload=(colo.rest,))
    _step(st)
    _step(twin)
    for p, q in zip(st.actor.model.parameters(), twin.actor.model.parameters()):
        assert torch.equal(p, q)


def test_the_bytes_to_page_lock_are_what_moves_with_a_copy() -> None:
    """What trainer/turns.py checks against the host memory (host_memory.copies_pin_budget): the params if
    they move, the optimizer state that moves (Adam's moments the first step will make included) less what
    of it stays; never the gradients, which are dropped, not copied."""
    from rlslurm.trainer.offload_choice import pending_optimizer_bytes

    st = _state()
    colo = bare_colocation(st, torch.device("cpu"), ("grads",))
    pending = pending_optimizer_bytes(st, torch.device("cpu"))
    assert pending > 0 and colo.copy_bytes() == 0
    colo.moves = ("grads", "rest")
    colo.rest.keep = 16
    assert colo.copy_bytes() == colo.rest.nbytes + pending - 16
    colo.moves = ("params", "grads", "rest")
    assert colo.copy_bytes() == colo.params.nbytes + colo.rest.nbytes + pending - 16
