"""The order a quantizing export sends its tensors in (convert/fp8.py `Fp8Export`, convert/int4.py
`Int4Export`): the quantized weights where their bf16 weights were, and their scales, shapes and the
small unquantized tensors (norms, biases) after the big ones, one run per dtype. A flattened bucket
holds one dtype (trainer/weights/group.py `iter_buckets`), and interleaving them would cut a bucket at
every norm. SGLang applies a sync's tensors when the update ends (/end_weight_update runs its
post-load step), so a scale may arrive after its weight.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch

# unquantized tensors up to this size go out after the big ones
SMALL_BYTES = 1 << 20

Named = tuple[str, torch.Tensor]


def small_last(stream: Iterable[Named], names: frozenset[str],
               quantize_one: Callable[[str, torch.Tensor], tuple[list[Named], list[Named]]]) -> Iterator[Named]:
    """`stream` with each tensor named in `names` replaced by `quantize_one(name, t)`: its first list
    goes out in the tensor's place, its second after the big tensors, with the small unquantized ones."""
    tail: list[Named] = []
    for name, t in stream:
        if name in names:
            now, later = quantize_one(name, t)
            yield from now
            tail += later
        elif t.numel() * t.element_size() <= SMALL_BYTES:
            tail.append((name, t))
        else:
            yield name, t
    tail.sort(key=lambda nt: str(nt[1].dtype))  # stable: one run per dtype, each in export order
    yield from tail
