"""What of the trainer's moves between the GPU and host memory under --colocate, and how
(trainer/colocate.py's phases move it; docs/colocate.md).

Tensors move by storage: each distinct storage is copied to (pinned) host memory and resized to 0
bytes, then resized and copied back, so every view (megatron's params are views into its contiguous
buffers) is valid again afterwards, bit for bit. Three sets: the actor's params (they leave last: the
export for the publish reads them), the gradients (scratch: dropped and zeroed, never copied) and
everything else (optimizer state, ref, critic). `warm_process_groups` makes the gradient groups'
NCCL communicators while the GPU has room.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist


def torch_optimizers(opt: Any) -> Iterator[torch.optim.Optimizer]:
    """The torch optimizers inside megatron's wrappers (chained, mixed precision, distributed)."""
    if opt is None:
        return
    if hasattr(opt, "chained_optimizers"):
        for o in opt.chained_optimizers:
            yield from torch_optimizers(o)
    elif isinstance(opt, torch.optim.Optimizer):
        yield opt
    elif hasattr(opt, "optimizer"):
        yield from torch_optimizers(opt.optimizer)


def module_tensors(module: torch.nn.Module | None) -> Iterator[torch.Tensor]:
    """Params and buffers (not gradients: `module_grads`)."""
    if module is None:
        return
    for p in module.parameters():
        yield p.data
    # nn.Module's own: megatron's DDP shadows `buffers` with its list of param/grad buffers, whose
    # storages the params and main grads already reach
    yield from torch.nn.Module.buffers(module)


def module_grads(module: torch.nn.Module | None) -> Iterator[torch.Tensor]:
    """megatron's main grads (`param.main_grad`, a view of its grad buffer) and any `.grad`."""
    if module is None:
        return
    for p in module.parameters():
        g = getattr(p, "main_grad", None)
        if isinstance(g, torch.Tensor):
            yield g
        if p.grad is not None:
            yield p.grad


def optimizer_tensors(opt: Any) -> Iterator[torch.Tensor]:
    """Every tensor an optimizer holds: its (fp32 main) params and its state (Adam's moments)."""
    for o in torch_optimizers(opt):
        for group in o.param_groups:
            yield from (p.data for p in group["params"])
        for state in o.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


class PinBudget:
    """Bytes of host copies the trainer may still page-lock (trainer/host_memory.py copies_pin_budget);
    None: no limit. Shared by the sets that move; a copy past it stays pageable."""

    def __init__(self, remaining: int | None = None):
        self.remaining = remaining

    def take(self, nbytes: int) -> bool:
        if self.remaining is None:
            return True
        if nbytes > self.remaining:
            return False
        self.remaining -= nbytes
        return True


@dataclass
class _Stored:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None = None  # kept across rollouts: pinning gigabytes anew each time is slow
    on_host: bool = False  # off the device (for a scratch set: dropped)
    stays: bool = False  # on the device though its set moves: within the set's `keep`
    late: bool = False  # needed only at an optimizer step: its copy back may run beside the forward/backward


@dataclass
class TensorSet:
    """Distinct storages on `device`, moved to host memory and back as a whole. A `scratch` set's
    contents are not kept: its storages are freed on the offload and come back as zeros (the gradient
    buffers: every step zeroes them before its first backward, trainer/step.py, so their contents between
    steps are dead; copying them was a quarter of each move, qwen3-1.7B)."""

    device: torch.device
    stored: list[_Stored] = field(default_factory=list)
    scratch: bool = False
    # page-lock the host copies on a GPU while this lasts (trainer/host_memory.py; 0: every copy pageable)
    budget: PinBudget = field(default_factory=PinBudget)
    # bytes of the set that stay on the device though it moves (offload_choice: what of the optimizer state
    # fits beside the engines): storages in order while they fit; the last to stay leave first when it shrinks
    keep: int = 0

    @classmethod
    def of(cls, tensors: Iterable[torch.Tensor], device: torch.device, *, exclude: tuple["TensorSet", ...] = (),
           scratch: bool = False) -> "TensorSet":
        out = cls(device, scratch=scratch)
        out.add(tensors, exclude=exclude)
        return out

    def add(self, tensors: Iterable[torch.Tensor], *, exclude: tuple["TensorSet", ...] = (),
            late: Iterable[torch.Tensor] = ()) -> int:
        """The storages of `tensors` on the device not in this set (nor in `exclude`) yet; their bytes.
        Identity is the storage itself (`_cdata`), which a move keeps, not its address, which it changes.
        Those also among `late` (optimizer state) are marked so: `onload(defer_late=True)` defers them."""
        seen = {s.storage._cdata for s in (*self.stored, *(x for e in exclude for x in e.stored))}
        late_ids = {t.untyped_storage()._cdata for t in late}
        added = 0
        for t in tensors:
            st = t.untyped_storage()
            if t.device != self.device or st.nbytes() == 0 or st._cdata in seen:
                continue
            seen.add(st._cdata)
            self.stored.append(_Stored(st, st.nbytes(), late=st._cdata in late_ids))
            added += st.nbytes()
        return added

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.stored)

    @property
    def device_nbytes(self) -> int:
        """The bytes of the set on the device now."""
        return sum(s.nbytes for s in self.stored if not s.on_host)

    @property
    def offloaded(self) -> bool:
        return any(s.on_host for s in self.stored)

    def _mark_stays(self) -> None:
        """Which storages stay within `keep`: those that stayed, in order, while they fit; then, in order,
        others on the device (new ones: Adam's moments, made at the first step) in what is left. A storage on
        the host does not become one that stays: it comes back at the next onload."""
        kept = 0
        for s in self.stored:
            if s.stays:
                s.stays = kept + s.nbytes <= self.keep
                kept += s.nbytes if s.stays else 0
        for s in self.stored:
            if not s.stays and not s.on_host and kept + s.nbytes <= self.keep:
                s.stays, kept = True, kept + s.nbytes

    def offload(self) -> int:
        pin = self.device.type == "cuda"
        self._mark_stays()
        for s in self.stored:
            if s.on_host or s.stays:
                continue
            if not self.scratch:
                if s.host is None:
                    s.host = torch.empty(s.nbytes, dtype=torch.uint8, pin_memory=pin and self.budget.take(s.nbytes))
                s.host.copy_(torch.empty(0, dtype=torch.uint8, device=self.device).set_(s.storage))
            s.storage.resize_(0)
            s.on_host = True
        return self.nbytes

    def onload(self, *, defer_late: bool = False) -> "LateCopy | None":
        """Everything back on the device. With `defer_late`, the storages marked late are allocated now but
        filled by the LateCopy returned (None when there are none): on a GPU on a side stream from now, on
        a CPU at its `wait`. Their contents are valid only after `wait`."""
        late: list[tuple[torch.Tensor, torch.Tensor]] = []
        for s in self.stored:
            if not s.on_host:
                continue
            s.storage.resize_(s.nbytes)
            view = torch.empty(0, dtype=torch.uint8, device=self.device).set_(s.storage)
            if self.scratch:
                view.zero_()
            elif defer_late and s.late:
                late.append((view, s.host))
            else:
                view.copy_(s.host)
            s.on_host = False
        return LateCopy(self.device, late) if late else None


class LateCopy:
    """Host-to-device copies of storages already allocated, started beside whatever the caller does next
    (the first forward/backward of a turn: the optimizer state is read only at the optimizer step).

    On a GPU they run on a stream of their own; the storages were allocated on the current stream and
    are freed only after `wait` (every move waits first: trainer/colocate.py), so no other work can reuse
    their blocks meanwhile. From pinned host memory the copies overlap the compute; from pageable memory
    torch copies synchronously, which is correct and only slower. On a CPU nothing overlaps: the copies
    run at `wait`."""

    def __init__(self, device: torch.device, copies: list[tuple[torch.Tensor, torch.Tensor]]):
        self.nbytes = sum(dst.numel() for dst, _ in copies)
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] | None = copies
        self._done: torch.cuda.Event | None = None
        if device.type == "cuda":
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))  # after the allocations
            with torch.cuda.stream(stream):
                for dst, src in copies:
                    dst.copy_(src, non_blocking=True)
                self._done = stream.record_event()
            self._copies = None

    def wait(self) -> None:
        """Until every copy is done (the host waits: the caller measures what the overlap did not hide)."""
        if self._done is not None:
            self._done.synchronize()
            self._done = None
        if self._copies is not None:
            for dst, src in self._copies:
                dst.copy_(src)
            self._copies = None


def other_tensors(st: Any) -> list[torch.Tensor]:
    """Everything of the trainer's kept across a move but the actor's params: optimizer states, ref, critic."""
    rest: list[torch.Tensor] = [*module_tensors(st.actor.model), *optimizer_tensors(st.actor.optimizer),
                                *module_tensors(st.ref)]
    if st.critic is not None:
        rest += [*module_tensors(st.critic.model), *optimizer_tensors(st.critic.optimizer)]
    return rest


def grad_tensors(st: Any) -> list[torch.Tensor]:
    """The gradients (actor and critic): scratch between steps."""
    return [*module_grads(st.actor.model), *module_grads(st.critic.model if st.critic is not None else None)]


def optimizer_state(st: Any) -> list[torch.Tensor]:
    """The optimizers' tensors (actor and critic): read and written only by an optimizer step (its copy back
    to the GPU may run beside the turn's first forward/backward: `LateCopy`)."""
    return [*optimizer_tensors(st.actor.optimizer),
            *(optimizer_tensors(st.critic.optimizer) if st.critic is not None else ())]


def trainer_tensor_sets(st: Any, device: torch.device) -> tuple[TensorSet, TensorSet, TensorSet]:
    """(the actor's params and buffers, the gradients (scratch), everything else on `device`, its optimizer
    state marked late). The buffers go with the params: the weight export reads them while the rest is off
    the GPU (an MoE router's expert bias: left behind, the first publish of tiny-glm4-moe read a freed
    storage and the trainer died of an illegal memory access, docs/colocate.md)."""
    model = st.actor.model
    # nn.Module's buffers: megatron's DDP wrapper has a `buffers` attribute of its own (its grad buffers)
    params = TensorSet.of((*(p.data for p in model.parameters()), *torch.nn.Module.buffers(model)), device)
    grads = TensorSet.of(grad_tensors(st), device, exclude=(params,), scratch=True)
    rest = TensorSet(device)
    rest.add(other_tensors(st), exclude=(params, grads), late=optimizer_state(st))
    return params, grads, rest


def warm_process_groups(device: torch.device, *, experts: bool) -> None:
    """One tiny all-reduce on the groups megatron reduces gradients over, while the GPU has room. NCCL
    makes a group's communicator at its first collective and allocates its buffers with plain
    cudaMalloc, which torch's caching allocator cannot give back to; megatron's first gradient
    all-reduce comes at the end of the first backward, when that cache holds the memory the released
    engines left, and NCCL's allocation failed there ("Failed to CUDA calloc 536870912 bytes";
    bench/results/colocate-h100.md). Only those groups: each communicator keeps its buffers (warming
    every megatron group kept GiBs more on the GPU, the same file)."""
    from megatron.core import parallel_state as ps

    groups = [ps.get_data_parallel_group(with_context_parallel=True)]  # DDP's gradient buckets
    if experts:
        groups.append(ps.get_expert_data_parallel_group())  # the experts' gradient buckets
    if ps.get_pipeline_model_parallel_world_size() > 1 and ps.is_rank_in_embedding_group():
        groups.append(ps.get_embedding_group())  # tied embeddings' gradients across the first/last stage
    for g in groups:
        dist.all_reduce(torch.zeros(1, device=device), group=g)
    torch.cuda.synchronize(device)
