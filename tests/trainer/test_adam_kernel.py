"""rlslurm/trainer/adam_kernel.py: torch's AdamW, as megatron-core builds it when it finds neither
transformer-engine's nor Apex's FusedAdam (the GPU stack, the CPU stack), steps with torch's fused kernel:
its update is that of an AdamW made with fused=True, bit for bit, also after a state dict saved without
the flag is loaded (a checkpoint's param groups bring their own). The memory it saves is a GPU figure
(bench/results/gpu-lease-2026-12-07d.md); here the CPU's fused kernel runs the same bookkeeping."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch

from rlslurm.trainer.adam_kernel import use_fused_adam


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))


def _megatrons(model: torch.nn.Module) -> torch.optim.AdamW:
    """As megatron-core's get_megatron_optimizer without TE/Apex: two groups (with and without weight decay),
    torch's defaults for the kernel."""
    decay = [p for p in model.parameters() if p.ndim > 1]
    rest = [p for p in model.parameters() if p.ndim <= 1]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=1e-2, betas=(0.9, 0.98), eps=1e-8, capturable=False)


def _fused_reference(model: torch.nn.Module) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.ndim > 1]
    rest = [p for p in model.parameters() if p.ndim <= 1]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=1e-2, betas=(0.9, 0.98), eps=1e-8, fused=True)


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    for i in range(n):
        opt.zero_grad()
        model(torch.full((3, 16), float(i + 1))).square().sum().backward()
        opt.step()


def _equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_megatrons_torch_adamw_steps_with_the_fused_kernel() -> None:
    ours, ref = _model(), _model()
    opt = _megatrons(ours)
    wrapped = SimpleNamespace(optimizer=opt)  # megatron's mixed-precision wrapper holds the torch optimizer
    assert use_fused_adam(wrapped) == 2
    assert all(g["fused"] and not g["foreach"] for g in opt.param_groups)
    ref_opt = _fused_reference(ref)
    _steps(ours, opt, 3)
    _steps(ref, ref_opt, 3)
    assert _equal(ours, ref)
    assert all(s["step"].dtype == torch.float32 for s in opt.state.values())


def test_a_state_saved_without_the_flag_steps_fused_again_after_the_load() -> None:
    saver = _model()
    plain = _megatrons(saver)
    _steps(saver, plain, 2)
    saved = plain.state_dict()
    assert not saved["param_groups"][0]["fused"]

    ours, ref = _model(), _model()
    for m in (ours, ref):
        m.load_state_dict(saver.state_dict())
    opt, ref_opt = _megatrons(ours), _fused_reference(ref)
    use_fused_adam(opt)
    opt.load_state_dict(copy.deepcopy(saved))  # each its own: the kernels count `step` in place
    ref_opt.load_state_dict(copy.deepcopy(saved))
    assert not opt.param_groups[0]["fused"]  # the load brought the saving optimizer's flags
    assert use_fused_adam(opt) == 2
    for g in ref_opt.param_groups:
        g["fused"], g["foreach"] = True, False
    _steps(ours, opt, 2)
    _steps(ref, ref_opt, 2)
    assert _equal(ours, ref)


def test_an_optimizer_that_is_not_torchs_adam_is_left_alone() -> None:
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    assert use_fused_adam(SimpleNamespace(optimizer=sgd)) == 0
    assert "fused" not in sgd.param_groups[0] or not sgd.param_groups[0]["fused"]
