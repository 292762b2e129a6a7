"""The entropy metric of the RL step (trainer/logprobs.py vocab_parallel_entropy) without a gradient: the
same numbers as the whole-tensor formula and an fp64 reference, with no vocabulary-sized temporary (what
qwen3-4B on one H100 ran out of memory on). The logits are random: an invented fixture."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlslurm.trainer.logprobs import vocab_parallel_entropy


class _LargestOutput(TorchDispatchMode):
    """The most elements any op's new output tensor had while active (a view of an input is not new)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in (*args, *(kwargs or {}).values())
                  if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.numel())
        return out


def _logits(n: int = 3, length: int = 37, v: int = 101) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    return torch.randn(n, length, v, generator=g) * 4.0


def test_metric_equals_the_whole_formula_and_fp64() -> None:
    x = _logits()
    p = torch.softmax(x.double(), dim=-1)
    ref = -(p * torch.log_softmax(x.double(), dim=-1)).sum(-1)[:, :-1]
    whole = vocab_parallel_entropy(x.clone().requires_grad_())  # the gradient path: whole tensors
    with torch.no_grad():
        for chunk in (1, x.shape[2] * 3 * 5, 1 << 26):  # a position at a time, 5 at a time, all at once
            h = vocab_parallel_entropy(x, chunk_elems=chunk)
            torch.testing.assert_close(h, whole.detach())
            torch.testing.assert_close(h.double(), ref, rtol=1e-5, atol=1e-5)
    assert x.equal(_logits()), "the logits must be left as they were: the cross entropy reads them after"


def test_metric_makes_no_vocabulary_sized_temporary() -> None:
    x = _logits()
    n, length, v = x.shape
    chunk = n * v * 4  # four positions of every row at a time
    with torch.no_grad(), _LargestOutput() as seen:
        vocab_parallel_entropy(x, chunk_elems=chunk)
    assert seen.largest <= chunk < x.numel() // 4, (seen.largest, chunk, x.numel())


def test_gradient_path_keeps_its_gradient() -> None:
    x = _logits().requires_grad_()
    vocab_parallel_entropy(x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
