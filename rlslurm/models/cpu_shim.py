"""Make megatron-core run on a machine without CUDA (developers' laptops, CI, the CPU demo).

megatron-core 0.16.x calls CUDA-only APIs in a handful of places that matter even when every
tensor lives on the CPU (docs/megatron-cpu.md, "What the CPU shim fakes"). `apply()`
patches exactly those, once per process, and does nothing at all when CUDA is available, so the
GPU path never sees any of this. Call it after `import torch` and before building a model.

Patches (name: what it fixes, megatron/core call sites in 0.16.1):

- `current_device`: `torch.cuda.current_device()` returns the CPU device. RoPE
  `inv_freq.to(current_device())` (models/common/embeddings/rotary_pos_embedding.py:162), DDP
  buffers (distributed/param_and_grad_buffer.py:806), checkpoint save
  (dist_checkpointing/strategies/state_dict_saver.py:252), inference generators.
- `synchronize`: `torch.cuda.synchronize()` is a no-op; checkpoint save calls it after its
  preload (dist_checkpointing/strategies/filesystem_async.py:230).
- `rng`: the "CUDA" RNG of megatron's model-parallel RNG tracker is the CPU default generator
  (`torch.cuda.get_rng_state/set_rng_state/manual_seed` and megatron's
  `_get_cuda_rng_state/_set_cuda_rng_state`, tensor_parallel/random.py:55,235,237,423). Without
  it `model_parallel_cuda_manual_seed` fails and so does every attention forward, which forks the
  tracker (transformer/dot_product_attention.py:217). `torch.cuda.manual_seed` must not go
  through `torch.manual_seed`: that calls back into `torch.cuda.manual_seed_all` and recurses.
- `cuda_mode`: a process-wide `TorchFunctionMode` that maps `device="cuda"`/`"cuda:N"`/int
  devices to the CPU, makes `.cuda()` a no-op and `.to("cuda")` stay on CPU, drops
  `pin_memory=True`, and makes `Tensor.type()` report `torch.cuda.*` names. Needed by the
  optimizer's `torch.tensor([1.0], device='cuda')` (optimizer/optimizer.py:907), the schedules'
  token counters (pipeline_parallel/schedules.py:596,983), grad-norm/clip buffers
  (optimizer/clip_grads.py:90-207), the default causal mask (transformer/utils.py:35), and the
  optimizers' `param.type() == 'torch.cuda.FloatTensor'` checks (clip_grads.py:167,
  distrib_optimizer.py:361,420,582, optimizer.py:671,690).
- `cuda_events`: `torch.cuda.Event`, `Stream`, `stream`, `current_stream`, `memory_stats` and nvtx
  ranges become inert stand-ins (inference controller text_generation_controller.py:1163, the MoE
  alltoall dispatcher's side stream token_dispatcher.py:445).
- `moe_host_splits`: the MoE alltoall dispatcher moves its per-rank token counts to the host
  with `maybe_move_tensor_to_cpu(..., as_numpy=True)`, which converts only CUDA tensors; on the
  CPU they stay tensors and gloo's `all_to_all_single` refuses tensors as split sizes
  (transformer/moe/token_dispatcher.py:879-886, moe_utils.py:1093). CPU tensors become numpy
  arrays too, as CUDA ones do. Needed at EP > 1.
- `sp_uneven_collectives`: with TP > 1 the alltoall dispatcher gathers and reduce-scatters
  token counts that differ per TP rank (`_gather_along_first_dim` / `_reduce_scatter_along_first_dim`
  with split sizes, tensor_parallel/mappings.py:127-190, token_dispatcher.py:696); NCCL takes
  uneven lists, gloo's allgather refuses them ("invalid tensor size") and it has no list
  reduce-scatter. Those two calls become a padded all_gather and an all_reduce + split.
  Needed at EP > 1 with TP > 1.
- `moe_te_general_gemm`: megatron bug: `moe_utils` imports `te_general_gemm` inside
  try/except ImportError and never defines it on failure, so every MoE router without
  transformer-engine raises NameError (transformer/moe/moe_utils.py:1192). Defined as None.
  Also applied when CUDA is present but transformer-engine is not.
- `mla_linear` (0.19): MLA binds the duplicated `Linear` only when transformer-engine imports, so
  the duplicated down projections `rlslurm.models.build` uses without TE are refused; bound to
  megatron's own `post_training.modelopt.layers.Linear`.
- `mla_have_te`: without transformer-engine, `megatron.core.extensions.transformer_engine` still
  imports (binding `TELinear` to a stand-in), so `multi_latent_attention.HAVE_TE` is wrongly
  True and `isinstance(self.linear_proj, TELinear)` raises TypeError
  (transformer/multi_latent_attention.py:185). Set to the extension module's own HAVE_TE.

The last three are megatron bugs that are not about CUDA: `apply_megatron_fixes()` fixes each where
megatron's modules show it (transformer-engine missing or not importing), GPU or not (`apply()`
includes it, and `build_gpt_model` calls it); whether transformer-engine is installed decides
nothing here, nor which layer spec is built (--transformer-impl does: models/build.py).
`applied()` reports which patches are active.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_APPLIED: list[str] = []
_MODE: TorchFunctionMode | None = None


def _cpu_device(dev: Any) -> Any:
    """Map a CUDA device designation to the CPU; anything else passes through."""
    if isinstance(dev, torch.device):
        return torch.device("cpu") if dev.type == "cuda" else dev
    if isinstance(dev, str) and dev.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(dev, int) and not isinstance(dev, bool):
        return torch.device("cpu")  # megatron passes `torch.cuda.current_device()` ints around
    return dev


_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.DoubleTensor": "torch.cuda.DoubleTensor",
    "torch.LongTensor": "torch.cuda.LongTensor",
    "torch.IntTensor": "torch.cuda.IntTensor",
    "torch.ByteTensor": "torch.cuda.ByteTensor",
    "torch.BoolTensor": "torch.cuda.BoolTensor",
}


class _CudaToCpuMode(TorchFunctionMode):
    """Keeps megatron's hard-coded `device='cuda'` allocations on the CPU (see module doc)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1:
            first = args[1]
            if isinstance(first, (str, torch.device)) or (isinstance(first, int) and not isinstance(first, bool)):
                args = (args[0], _cpu_device(first), *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        if func is torch.Tensor.pin_memory:
            return args[0]
        return func(*args, **kwargs)


class _FakeEvent:
    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class _FakeStream(_FakeEvent):
    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record_event(self, *args: Any, **kwargs: Any) -> _FakeEvent:
        return _FakeEvent()


def _patch_rng() -> None:
    import megatron.core.tensor_parallel.random as mrandom

    gen = torch.default_generator
    torch.cuda.get_rng_state = lambda device="cuda": gen.get_state()  # type: ignore[assignment]
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state  # type: ignore[assignment]
    torch.cuda.set_rng_state = lambda state, device="cuda": gen.set_state(state)  # type: ignore[assignment]
    torch.cuda.manual_seed = lambda seed: gen.manual_seed(int(seed))  # type: ignore[assignment]
    torch.cuda.manual_seed_all = lambda seed: None  # type: ignore[assignment]

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return gen.get_state()

    def set_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
        gen.set_state(new_state)

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state


def _patch_moe_splits() -> None:
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    def to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = to_host
    dispatcher.maybe_move_tensor_to_cpu = to_host  # imported by name there


def _patch_uneven_collectives() -> None:
    import megatron.core.tensor_parallel.mappings as mappings
    import torch.distributed as dist

    gather, reduce_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather_uneven(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        n = max(output_split_sizes)
        padded = input_.new_zeros((n, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in output_split_sizes]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([p[:k] for p, k in zip(parts, output_split_sizes)])

    def reduce_scatter_uneven(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        return torch.split(total, input_split_sizes, dim=0)[group.rank()].clone()

    mappings._gather_along_first_dim = gather_uneven
    mappings._reduce_scatter_along_first_dim = reduce_scatter_uneven


def _patch_events() -> None:
    torch.cuda.Event = _FakeEvent  # type: ignore[misc,assignment]
    torch.cuda.Stream = _FakeStream  # type: ignore[misc,assignment]
    torch.cuda.current_stream = lambda device=None: _FakeStream()  # type: ignore[assignment]
    torch.cuda.default_stream = lambda device=None: _FakeStream()  # type: ignore[assignment]
    torch.cuda.stream = lambda s=None: contextlib.nullcontext()  # type: ignore[assignment]
    torch.cuda.memory_stats = lambda device=None: {}  # type: ignore[assignment]
    torch.cuda.nvtx.range_push = lambda msg: 0  # type: ignore[assignment]
    torch.cuda.nvtx.range_pop = lambda: 0  # type: ignore[assignment]


_MEGATRON_FIXED: list[str] = []


def apply_megatron_fixes() -> list[str]:
    """The transformer-engine-less megatron bugs only (GPU or not), each where megatron's modules show
    it; idempotent. Returns their names.

    `rlslurm.models.build.build_gpt_model` calls this itself, so a GPU trainer that never calls
    `apply()` still gets them.
    """
    if _MEGATRON_FIXED:
        return list(_MEGATRON_FIXED)
    _MEGATRON_FIXED.append("checked")
    import megatron.core.extensions.transformer_engine as te_extension
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
        _MEGATRON_FIXED.append("moe_te_general_gemm")
    try:
        import megatron.core.transformer.multi_latent_attention as mla
    except ImportError:  # a layout without MLA: nothing to fix
        return list(_MEGATRON_FIXED)
    if getattr(mla, "HAVE_TE", False) and not getattr(te_extension, "HAVE_TE", False):
        mla.HAVE_TE = False
        _MEGATRON_FIXED.append("mla_have_te")
    if hasattr(mla, "Linear") and mla.Linear is None:
        # megatron-core 0.19 binds MLA's duplicated `Linear` only when TE imports, so the
        # duplicated down projections (rlslurm.models.build) are refused as "Unsupported".
        from megatron.core.post_training.modelopt.layers import Linear

        mla.Linear = Linear
        _MEGATRON_FIXED.append("mla_linear")
    return list(_MEGATRON_FIXED)


def apply() -> None:
    """Apply the CPU patches once; a no-op (apart from the two TE-less megatron bugs) with CUDA."""
    global _MODE
    if _APPLIED:
        return
    _APPLIED.extend(f for f in apply_megatron_fixes() if f != "checked")
    if torch.cuda.is_available():
        _APPLIED.append("none:cuda-available")
        return
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    _patch_rng()
    _patch_events()
    _patch_moe_splits()
    _patch_uneven_collectives()
    _MODE = _CudaToCpuMode()
    _MODE.__enter__()  # stays entered for the life of the process, by design
    _APPLIED.extend(["current_device", "synchronize", "rng", "cuda_events", "moe_host_splits", "sp_uneven_collectives",
                     "cuda_mode"])


def applied() -> list[str]:
    """Names of the patches `apply()` put in place (empty before `apply()`)."""
    return list(_APPLIED)
