"""Packed (thd) rotary embeddings without a host read-back (rlslurm/models/packed_rope.py) against
megatron-core's own: the same values bit for bit, with no `tolist`/`item` on the way (each one a wait
for the GPU's queue, per layer), and in place in the attention modules once a model is built."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.megatron


@pytest.fixture
def cp_group():
    """A real one-rank group: megatron's thd rotary asks it for the context-parallel size and rank."""
    mine = not dist.is_initialized()
    if mine:
        from rlslurm.net import free_port

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield dist.new_group([0], backend="gloo")
    if mine:
        dist.destroy_process_group()


def _config(*, interleaved: bool):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, rotary_interleaved=interleaved,
                             apply_rope_fusion=False)


def _inputs(lengths: list[int], heads: int = 4, dim: int = 16, seed: int = 0):
    """Packed q (or k) [t, h, d], cu_seqlens, and rotary frequencies [max_s, 1, 1, d] as megatron's
    RotaryEmbedding makes them (base 10000, halves repeated)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(sum(lengths), heads, dim, generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    inv = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    f = torch.outer(torch.arange(max(lengths), dtype=torch.float32), inv)
    return t, cu, torch.cat([f, f], dim=-1)[:, None, None, :]


class ReadBacks:
    """Counts the tensor-to-host reads made meanwhile (each one waits for the GPU's queue there)."""

    NAMES = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__")

    def __enter__(self):
        self.count, self._orig = 0, {n: getattr(torch.Tensor, n) for n in self.NAMES}

        def counted(f):
            def g(t, *a, **k):
                self.count += 1
                return f(t, *a, **k)
            return g
        for n, f in self._orig.items():
            setattr(torch.Tensor, n, counted(f))
        return self

    def __exit__(self, *exc):
        for n, f in self._orig.items():
            setattr(torch.Tensor, n, f)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("mscale", [1.0, 1.25])
def test_packed_rotary_equals_megatrons_without_a_read_back(cp_group, interleaved: bool, mscale: float) -> None:
    from megatron.core.models.common.embeddings import rope_utils

    from rlslurm.models.packed_rope import _wrap

    ours = _wrap(rope_utils.apply_rotary_pos_emb)
    config = _config(interleaved=interleaved)
    t, cu, freqs = _inputs([7, 1, 12, 5])
    with ReadBacks() as theirs_reads:
        want = rope_utils.apply_rotary_pos_emb(t, freqs, config=config, cu_seqlens=cu, mscale=mscale, cp_group=cp_group)
    with ReadBacks() as our_reads:
        got = ours(t, freqs, config=config, cu_seqlens=cu, mscale=mscale, cp_group=cp_group)
    assert torch.equal(got, want)
    assert theirs_reads.count > 0  # megatron's reads the lengths back: what this replaces
    assert our_reads.count == 0


def test_token_positions_restart_at_each_sequence() -> None:
    from rlslurm.models.packed_rope import token_positions

    cu = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    assert token_positions(cu, 8).tolist() == [0, 1, 2, 0, 0, 1, 2, 3]


def test_cases_it_does_not_handle_go_to_megatrons(cp_group) -> None:
    """Frequencies as long as the pack (megatron's per-token "exact mapping") and unpacked inputs go to
    megatron's own: equal results, megatron's read-backs."""
    from megatron.core.models.common.embeddings import rope_utils

    from rlslurm.models.packed_rope import _wrap

    ours = _wrap(rope_utils.apply_rotary_pos_emb)
    config = _config(interleaved=False)
    t, cu, _ = _inputs([4, 6])
    _, _, whole = _inputs([10])  # [10, 1, 1, d]: one frequency per packed token
    want = rope_utils.apply_rotary_pos_emb(t, whole, config=config, cu_seqlens=cu, cp_group=cp_group)
    with ReadBacks() as reads:
        got = ours(t, whole, config=config, cu_seqlens=cu, cp_group=cp_group)
    assert torch.equal(got, want) and reads.count > 0
    bshd = t.view(10, 1, 4, 16)
    assert torch.equal(ours(bshd, whole, config=config, cp_group=cp_group),
                       rope_utils.apply_rotary_pos_emb(bshd, whole, config=config, cp_group=cp_group))


def test_install_puts_it_in_megatrons_attention_once() -> None:
    import megatron.core.transformer.attention as attention
    from megatron.core.models.common.embeddings import rope_utils

    from rlslurm.models import packed_rope

    packed_rope.install()
    first = attention.apply_rotary_pos_emb
    assert first.megatrons is rope_utils.apply_rotary_pos_emb
    packed_rope.install()
    assert attention.apply_rotary_pos_emb is first
