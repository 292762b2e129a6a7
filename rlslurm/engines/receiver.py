"""rlslurm's weight receiver inside an SGLang engine: buckets copied straight into the engine's
parameters, received by broadcast (one request per publish, two alternating buffers) or read in place
from the trainer's buffer on the same GPU (--colocate: engines/shared_buffer.py, one request per bucket).

Loaded by the engine itself: the rollout node starts SGLang with `--custom-weight-loader
rlslurm.engines.receiver.receive` (a documented SGLang extension point, present in 0.5.14 and
0.5.23: `/update_weights_from_tensor` with `load_format` naming the loader calls
`loader(model, named_tensors)` in every TP worker; docs/sglang-behaviour.md). The trainer
(trainer/weights/broadcast.py, `--update-weight-receiver rlslurm`) sends one such request whose only
entry is named `PLAN_PREFIX + <json plan>`, then broadcasts each bucket's bytes (flattened, one
dtype per bucket) on the weight-update group the engine joined with /init_weights_update_group.

Why: SGLang's own path takes one HTTP request and one python `load_weights` per bucket, serially
with the broadcast (bench/results/engine-sync-*.md: 0.24-0.35 of a raw broadcast). Here the
broadcast of bucket k+1 runs while bucket k is copied (two buffers; the NCCL stream waits for the
copies enqueued before it, so a buffer is not overwritten early), and the copies of a bucket are
one `torch._foreach_copy_`.

The copy map is learnt, not written per model family: the first time a bucket layout is seen,
SGLang's own `model.load_weights` runs on views of the received buffer under a TorchFunctionMode
that records every `copy_` whose source is a view of the buffer. The map is used from then on only
if the recording is complete: every received byte was a copy source, every destination is storage
of a model parameter or buffer, and no parameter was re-assigned. Otherwise that layout keeps
using `load_weights` on the views (still one request, still overlapped with the receive).

A plan with `sources` instead of `group` (trainer/weights/ipc.py) names, for each bucket, the buffer the
trainer wrote it into: the receiver opens it (a CUDA IPC handle, or a memfd on CPU) and copies from it
with the same learnt map; it answers only once its copies are done, so the trainer may then reuse it.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

log = logging.getLogger("rlslurm.engines.receiver")

LOADER = "rlslurm.engines.receiver.receive"  # the value of SGLang's --custom-weight-loader
PLAN_PREFIX = "rlslurm-receive:"


# --- the plan, as the trainer sends it -------------------------------------------------------

@dataclass(frozen=True)
class BucketPlan:
    nbytes: int
    dtype: str                                  # one dtype per bucket
    tensors: tuple[tuple[str, tuple[int, ...], int], ...]  # (name, shape, byte offset)

    def key(self) -> tuple:
        return (self.nbytes, self.dtype, self.tensors)


def _payload(buckets: list[BucketPlan], **how: Any) -> str:
    """A plan as the name of the request's one entry. `sent_at` (the trainer's clock) lets the engine
    log how long the request took to reach it."""
    return PLAN_PREFIX + json.dumps({**how, "sent_at": time.time(), "buckets": [
        {"nbytes": b.nbytes, "dtype": b.dtype, "tensors": [[n, list(s), o] for n, s, o in b.tensors]}
        for b in buckets]}, separators=(",", ":"))


def plan_payload(group_name: str, buckets: list[BucketPlan]) -> str:
    """The entry for buckets broadcast on the weight-update group `group_name` (trainer side)."""
    return _payload(buckets, group=group_name)


def mapped_payload(buckets: list[BucketPlan], sources: list[dict[str, Any]]) -> str:
    """The entry for buckets the engine reads from the trainer's buffers (engines/shared_buffer.py)."""
    if len(buckets) != len(sources):
        raise ValueError(f"{len(buckets)} buckets, {len(sources)} sources")
    return _payload(buckets, sources=sources)


def _parse(name: str) -> tuple[dict[str, Any], list[BucketPlan]]:
    if not name.startswith(PLAN_PREFIX):
        raise ValueError(f"{LOADER}: expected one entry named {PLAN_PREFIX}<plan>, got {name[:60]!r}")
    obj = json.loads(name[len(PLAN_PREFIX):])
    buckets = [BucketPlan(int(b["nbytes"]), str(b["dtype"]),
                          tuple((str(n), tuple(int(x) for x in s), int(o)) for n, s, o in b["tensors"]))
               for b in obj["buckets"]]
    return obj, buckets


def parse_plan(name: str) -> tuple[str, list[BucketPlan], float]:
    obj, buckets = _parse(name)
    return str(obj["group"]), buckets, float(obj.get("sent_at", 0.0))


# --- recording SGLang's load_weights --------------------------------------------------------

@dataclass
class _Copy:
    dst: torch.Tensor        # a view of a parameter's storage (kept: the storage lives as long as the model)
    offset: int              # the source's storage offset in elements of its dtype, within the bucket buffer
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class _CopyMap:
    copies: list[_Copy] = field(default_factory=list)
    # constant fills of parameter regions (SGLang zeroes a padded vocabulary's extra rows), replayed
    # after the copies: learnt only where no fill overlaps a copy, so their order does not matter
    fills: list[tuple[torch.Tensor, float]] = field(default_factory=list)
    complete: bool = False
    why: str = ""


_INPLACE_DUNDERS = frozenset(f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow",
                                                        "and", "or", "xor", "lshift", "rshift", "matmul"))


class _Recorder(TorchFunctionMode):
    """Watches SGLang's load_weights run on views of `buf` (one uint8 buffer): records each
    `param_view.copy_(buf_view)`, and notes anything a replay of those copies would not redo: a
    buffer view materialised into new memory (`.to`, `.contiguous`, `cat`, arithmetic), a
    parameter written other than by a copy from the buffer, or a parameter read into new memory:
    state derived from the weights, such as the MLA models' `w_kc`/`w_vc`, which SGLang's
    `post_load_weights` recomputes from `kv_b_proj` inside load_weights (docs/sglang-behaviour.md)."""

    def __init__(self, buf: torch.Tensor, params: set[int]):
        super().__init__()
        self.base = buf.untyped_storage().data_ptr()
        self.params = params
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.fills: list[tuple[torch.Tensor, float]] = []
        self.unfaithful: list[str] = []

    def _is(self, t: Any, ptr: int) -> bool:
        return isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == ptr

    @staticmethod
    def _tensors(args: Any, kwargs: dict) -> list[torch.Tensor]:
        flat = list(args) + list(kwargs.values())
        flat += [x for a in flat if isinstance(a, (list, tuple)) for x in a]
        return [a for a in flat if isinstance(a, torch.Tensor)]

    def _reads_buf(self, args: Any, kwargs: dict) -> bool:
        return any(self._is(a, self.base) for a in self._tensors(args, kwargs))

    def _reads_param(self, args: Any, kwargs: dict) -> bool:
        return any(a.untyped_storage().data_ptr() in self.params for a in self._tensors(args, kwargs))

    def _new_memory(self, out: Any) -> bool:
        """Whether an op's result holds a tensor in memory other than the buffer's or a parameter's."""
        outs = out if isinstance(out, (list, tuple)) else [out]
        return any(isinstance(o, torch.Tensor) and not self._is(o, self.base)
                   and o.untyped_storage().data_ptr() not in self.params for o in outs)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        out = func(*args, **kwargs)
        dst = args[0] if args and isinstance(args[0], torch.Tensor) else None
        is_param = dst is not None and dst.untyped_storage().data_ptr() in self.params
        if isinstance(kwargs.get("out"), torch.Tensor) and kwargs["out"].untyped_storage().data_ptr() in self.params:
            self.unfaithful.append(f"a parameter written by {name}(out=)")
        elif name == "__setitem__" and is_param:
            # param[idx] = bucket view: a copy into the indexed view (basic indexing only)
            value = args[2] if len(args) > 2 else None
            view = dst.__getitem__(args[1]) if self._is(value, self.base) else None
            if view is not None and view.untyped_storage().data_ptr() == dst.untyped_storage().data_ptr() \
                    and view.shape == value.shape:
                self.copies.append((view, value))
            else:
                self.unfaithful.append("a parameter written by item assignment")
        elif name == "copy_" and dst is not None and len(args) >= 2:
            if self._is(args[1], self.base):
                self.copies.append((dst, args[1]))
            elif dst.untyped_storage().data_ptr() in self.params:
                self.unfaithful.append("a parameter copied from elsewhere than the bucket")
        elif is_param and (name.endswith("_") and not name.startswith("__") or name in _INPLACE_DUNDERS):
            if name == "zero_":
                self.fills.append((dst, 0.0))
            elif name == "fill_" and len(args) == 2 and isinstance(args[1], (int, float)):
                self.fills.append((dst, float(args[1])))
            else:
                self.unfaithful.append(f"a parameter written by {name}")
        elif self._reads_buf(args, kwargs):
            outs = out if isinstance(out, (list, tuple)) else [out]
            if any(isinstance(o, torch.Tensor) and not self._is(o, self.base) for o in outs):
                self.unfaithful.append(f"the bucket read by {name}")
        elif self._reads_param(args, kwargs) and self._new_memory(out):
            self.unfaithful.append(f"a parameter read into new memory by {name} (state derived from the weights)")
        return out


def _param_storages(model: torch.nn.Module) -> dict[int, str]:
    return {p.untyped_storage().data_ptr(): n
            for n, p in list(model.named_parameters()) + list(model.named_buffers())}


def _learn(model: torch.nn.Module, buf: torch.Tensor, plan: BucketPlan) -> _CopyMap:
    """Load one bucket with SGLang's load_weights, recording where its bytes went. A tensor with
    no recorded copy was skipped by load_weights (e.g. a tied lm_head): the replay skips it too."""
    dtype = getattr(torch, plan.dtype)
    views = _views(buf, plan)
    before = _param_storages(model)
    rec = _Recorder(buf, set(before))
    with rec:
        model.load_weights(views)
    cmap = _CopyMap()
    if _param_storages(model) != before:
        cmap.why = "load_weights re-assigned parameters"
    elif rec.unfaithful:
        cmap.why = sorted(set(rec.unfaithful))[0]
    elif any(src.dtype != dtype for _, src in rec.copies):
        cmap.why = "a copy read the bucket as another dtype"
    else:
        if any(_overlap(f, dst) for f, _ in rec.fills for dst, _ in rec.copies):
            cmap.why = "a constant fill overlaps a copy"
            return cmap
        cmap.copies = [_Copy(dst, src.storage_offset(), tuple(src.shape), tuple(src.stride()), dtype)
                       for dst, src in rec.copies]
        cmap.fills = rec.fills
        cmap.complete = True
    return cmap


def _extent(t: torch.Tensor) -> tuple[int, int, int]:
    """(storage, first byte, last byte + 1) that a view can touch."""
    span = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0) + 1 if t.numel() else 0
    start = t.storage_offset() * t.element_size()
    return t.untyped_storage().data_ptr(), start, start + span * t.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    sa, a0, a1 = _extent(a)
    sb, b0, b1 = _extent(b)
    return sa == sb and a0 < b1 and b0 < a1


def _typed(buf: torch.Tensor, plan: BucketPlan) -> torch.Tensor:
    """The bucket's bytes as its one dtype."""
    return buf[:plan.nbytes].view(getattr(torch, plan.dtype))


def _views(buf: torch.Tensor, plan: BucketPlan) -> list[tuple[str, torch.Tensor]]:
    """The bucket's named tensors, viewed in place (what SGLang's load_weights takes)."""
    typed = _typed(buf, plan)
    es = typed.element_size()
    return [(n, typed[o // es:o // es + math.prod(s)].view(s)) for n, s, o in plan.tensors]


# --- the receiver ----------------------------------------------------------------------------

# Buffers SGLang fills from a weight at a forward and never refreshes when the weights change: dropped
# after every update so that the next forward rebuilds them from the new weights. SGLang 0.5.14's
# glm4_moe.py and glm4_moe_lite.py Glm4MoeGate keep the router weight in fp32 as `_weight_fp32` (its
# own FIXME; 0.5.23 casts at each forward): GLM-4.5 and GLM-4.7-Flash engines would route with the
# weights they started with (docs/sglang-behaviour.md).
STALE_CACHES = ("_weight_fp32",)


class _Receiver:
    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.maps: dict[tuple, _CopyMap] = {}
        self.cached = [(m, b) for m in model.modules() for b in STALE_CACHES if b in m._buffers]

    def drop_caches(self) -> None:
        for module, name in self.cached:
            setattr(module, name, None)

    def run(self, group: Any, buckets: list[BucketPlan]) -> dict[str, float]:
        """Receive and load every bucket; returns timings (s): until the first bucket arrived, the
        last one arrived, and the loads were done, from entry (CUDA events on GPU: no extra sync)."""
        dev = next(self.model.parameters()).device
        cuda = dev.type == "cuda"
        t0 = time.perf_counter()
        start = torch.cuda.Event(enable_timing=True) if cuda else None
        arrived: list[Any] = []
        if start is not None:
            start.record()
        size = max((b.nbytes for b in buckets), default=0)
        bufs = [torch.empty(size, dtype=torch.uint8, device=dev) for _ in range(min(2, len(buckets)))]
        pending = None
        if buckets:
            pending = dist.broadcast(bufs[0][:buckets[0].nbytes], src=0, group=group, async_op=True)
        for k, plan in enumerate(buckets):
            pending.wait()
            arrived.append(_mark(cuda, t0))
            buf = bufs[k % 2]
            if k + 1 < len(buckets):  # the next bucket arrives while this one is copied
                pending = dist.broadcast(bufs[(k + 1) % 2][:buckets[k + 1].nbytes], src=0, group=group,
                                         async_op=True)
            self._load(buf, plan)
        self.drop_caches()
        end = _mark(cuda, t0)
        if cuda:
            torch.cuda.current_stream(dev).synchronize()  # the buffers are freed next
        if not arrived:
            return {}
        at = (lambda e: start.elapsed_time(e) / 1e3) if cuda else (lambda e: e)
        return {"first bucket in": at(arrived[0]), "last bucket in": at(arrived[-1]), "loaded": at(end)}

    def run_mapped(self, buckets: list[BucketPlan], sources: list[dict[str, Any]]) -> dict[str, float]:
        """Copy every bucket from the trainer's buffer it names; returns the seconds until the copies
        were done (synchronised: the trainer overwrites the buffer once this request is answered)."""
        from rlslurm.engines.shared_buffer import open_source

        t0 = time.perf_counter()
        opened = []  # kept open until the copies from them are done
        for plan, src in zip(buckets, sources, strict=True):
            buf = open_source(src)  # on CUDA the stream waits for the trainer's copy into it
            if buf.numel() < plan.nbytes:
                raise ValueError(f"{LOADER}: a {buf.numel()}-byte buffer for a {plan.nbytes}-byte bucket")
            self._load(buf, plan)
            opened.append(buf)
        self.drop_caches()
        dev = next(self.model.parameters()).device
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()
        opened.clear()
        return {"loaded": time.perf_counter() - t0} if buckets else {}

    def _load(self, buf: torch.Tensor, plan: BucketPlan) -> None:
        cmap = self.maps.get(plan.key())
        if cmap is None:
            cmap = self.maps[plan.key()] = _learn(self.model, buf, plan)
            first = plan.tensors[0][0] if plan.tensors else ""
            # stderr: the engine's log, whatever SGLang made of the logging config
            print(f"rlslurm receiver: bucket of {len(plan.tensors)} tensors ({first} ...) "
                  + (f"copied by {len(cmap.copies)} learnt copies from now on" if cmap.complete
                     else f"keeps SGLang's load_weights: {cmap.why}"), file=sys.stderr, flush=True)
            return  # learning loaded it
        if not cmap.complete:
            self.model.load_weights(_views(buf, plan))
            return
        if cmap.copies:  # none: every tensor of the bucket is one load_weights skips (a tied lm_head)
            typed = _typed(buf, plan)
            srcs = [torch.as_strided(typed, c.size, c.stride, c.offset) for c in cmap.copies]
            torch._foreach_copy_([c.dst for c in cmap.copies], srcs)
        for dst, value in cmap.fills:
            dst.fill_(value)


def _mark(cuda: bool, t0: float) -> Any:
    """A point on the current stream (a recorded CUDA event), or seconds since t0 on CPU."""
    if not cuda:
        return time.perf_counter() - t0
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


_receivers: dict[int, _Receiver] = {}
_lock = threading.Lock()


def _group(name: str) -> Any:
    """The process group SGLang created for /init_weights_update_group, by its name."""
    from torch.distributed import distributed_c10d as c10d

    for pg, pg_name in list(c10d._world.pg_names.items()):
        if pg_name == name:
            return pg
    raise RuntimeError(f"{LOADER}: no weight-update group named {name!r} in this engine "
                       f"(/init_weights_update_group first)")


def receive(model: torch.nn.Module, named_tensors: list[tuple[str, Any]]) -> None:
    """SGLang's custom weight loader entry point (see the module docstring)."""
    if len(named_tensors) != 1:
        raise ValueError(f"{LOADER}: expected one plan entry, got {len(named_tensors)}")
    obj, buckets = _parse(named_tensors[0][0])
    sent_at = float(obj.get("sent_at", 0.0))
    reached = time.time()
    with _lock:
        r = _receivers.get(id(model))
        if r is None:
            r = _receivers[id(model)] = _Receiver(model)
    mapped = "sources" in obj
    t = r.run_mapped(buckets, obj["sources"]) if mapped else r.run(_group(str(obj["group"])), buckets)
    # one line per request in the engine's log: where a sync's time goes
    how = "read in place" if mapped else "broadcast"
    print(f"rlslurm receiver: {len(buckets)} buckets {how}, {sum(b.nbytes for b in buckets) / 1e9:.4f} GB: request "
          f"reached the engine {1e3 * (reached - sent_at):.1f} ms after it was sent; "
          + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in t.items()), file=sys.stderr, flush=True)
