"""rlslurm's engine receiver (rlslurm/engines/receiver.py) learns a bucket's copies from the model's
own `load_weights` and replays them on the next publish. Here a module written like SGLang's
loaders (stacked q/k/v rows, a skipped tied head, zero-filled vocabulary padding, item
assignment) must end with the same parameters after a replay as after its own `load_weights`;
loaders whose effect a replay would not redo (a dtype conversion, a re-assigned parameter) keep
`load_weights`, with the reason. The receive itself runs against real SGLang engines in
test_weight_sync_engines.py."""

from __future__ import annotations

import pytest
import torch

from rlslurm.engines.receiver import BucketPlan, _Receiver, parse_plan, plan_payload
from rlslurm.trainer.weights.buckets import bucket_plan

V, VP, H = 10, 12, 4  # vocabulary, padded vocabulary, hidden


class Engineish(torch.nn.Module):
    def __init__(self, style: str = "faithful"):
        super().__init__()
        self.style = style
        self.qkv = torch.nn.Parameter(torch.zeros(3 * H, H))
        self.embed = torch.nn.Parameter(torch.full((VP, H), 7.0))
        self.norm = torch.nn.Parameter(torch.zeros(H))

    def load_weights(self, weights):
        for name, w in weights:
            if name == "lm_head.weight":
                continue  # tied: SGLang's loaders skip it
            if name in ("q", "k", "v"):
                i = "qkv".index(name)
                self.qkv.data.narrow(0, i * H, H).copy_(w)
            elif name == "embed":
                self.embed.data[:V].copy_(w)
                self.embed.data[V:].fill_(0)  # padded rows
            elif name == "norm":
                if self.style == "converts":
                    self.norm.data.copy_(w.to(torch.float64).to(torch.float32))
                elif self.style == "reassigns":
                    self.norm.data = w.clone()
                else:
                    self.norm.data[:] = w


def _named(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [("q", torch.randn(H, H, generator=g)), ("k", torch.randn(H, H, generator=g)),
            ("v", torch.randn(H, H, generator=g)), ("embed", torch.randn(V, H, generator=g)),
            ("norm", torch.randn(H, generator=g)), ("lm_head.weight", torch.randn(V, H, generator=g))]


def _buffer(named: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    return torch.cat([t.reshape(-1).view(torch.uint8) for _, t in named])


def _state(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items()}


@pytest.mark.parametrize("style, learnt", [("faithful", True), ("converts", False), ("reassigns", False)])
def test_a_replay_ends_where_load_weights_ends(style: str, learnt: bool) -> None:
    plan = bucket_plan(_named(1))
    assert plan.nbytes == _buffer(_named(1)).numel() and plan.dtype == "float32"
    model, receiver = Engineish(style), _Receiver(Engineish(style))
    receiver.model = model
    receiver._load(_buffer(_named(1)), plan)  # learns, by running load_weights
    cmap = receiver.maps[plan.key()]
    assert cmap.complete is learnt, cmap.why
    if learnt:
        assert len(cmap.copies) == 5 and len(cmap.fills) == 1  # q, k, v, embed, norm; the padding
    else:
        reasons = {"converts": ("the bucket read by to", "a parameter copied from elsewhere than the bucket"),
                   "reassigns": ("load_weights re-assigned parameters",)}[style]
        assert cmap.why in reasons or cmap.why.startswith(reasons[0]), cmap.why
    receiver._load(_buffer(_named(2)), plan)  # replays (or keeps load_weights)
    reference = Engineish(style)
    reference.load_weights(_named(1))
    reference.load_weights(_named(2))
    got, want = _state(model), _state(reference)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert torch.equal(model.embed[V:], torch.zeros(VP - V, H))  # the fill is replayed


def test_the_plan_survives_the_request() -> None:
    plan = bucket_plan(_named(3))
    group, buckets, sent_at = parse_plan(plan_payload("rlslurm-wsync-a0-pp0-b1", [plan, plan]))
    assert group == "rlslurm-wsync-a0-pp0-b1" and buckets == [plan, plan] and sent_at > 0
    assert isinstance(buckets[0], BucketPlan)
    with pytest.raises(ValueError, match="expected one entry named rlslurm-receive:"):
        parse_plan("model.embed_tokens.weight")


def test_the_request_entry_unpickles_in_sglang_and_names_only_torch_tensor() -> None:
    """A pickled tensor names its storage loader, which megatron-core 0.19 replaces in the trainer
    process; SGLang's SafeUnpickler refused that and the engine died (2xH200). The entry must name
    no global but torch.Tensor, and load with the installed SGLang's own deserializer."""
    import base64
    import pickletools

    from sglang.srt.utils.common import MultiprocessingSerializer

    from rlslurm.trainer.weights.buckets import serialized_plan

    payload = serialized_plan(plan_payload("g", [bucket_plan(_named(4))]))
    ops = list(pickletools.genops(base64.b64decode(payload)))
    strings = [arg for op, arg, _ in ops if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE")]
    globals_ = sum(op.name in ("GLOBAL", "STACK_GLOBAL") for op, _, _ in ops)
    assert globals_ == 1 and strings[-2:] == ["torch", "Tensor"], strings
    (name, tensor), = MultiprocessingSerializer.deserialize(payload)
    assert parse_plan(name)[1] == [bucket_plan(_named(4))] and tensor.numel() == 0


def test_a_bucket_read_in_place_from_another_process_memfd() -> None:
    """--colocate's transport on CPU (engines/shared_buffer.py): a child process writes two buckets into
    its memfd buffer and stays alive; the receiver maps it through /proc/<pid>/fd, learns from the first
    and replays on the second, ending where load_weights ends."""
    import multiprocessing as mp

    from rlslurm.engines.receiver import _parse, mapped_payload

    plan = bucket_plan(_named(5))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_memfd_writer, args=(child,), daemon=True)
    proc.start()
    try:
        model = Engineish()
        receiver = _Receiver(model)
        for seed in (5, 6):
            parent.send(seed)
            src = parent.recv()
            obj, buckets = _parse(mapped_payload([plan], [src]))
            assert buckets == [plan] and obj["sources"] == [src]
            t = receiver.run_mapped(buckets, obj["sources"])
            assert set(t) == {"loaded"}
        assert receiver.maps[plan.key()].complete
        reference = Engineish()
        reference.load_weights(_named(6))
        for k, want in _state(reference).items():
            assert torch.equal(_state(model)[k], want), k
        with pytest.raises(ValueError, match="a 4-byte buffer for a"):
            receiver.run_mapped([plan], [dict(src, nbytes=4)])
    finally:
        parent.send(None)
        proc.join(timeout=30)


def _memfd_writer(conn) -> None:
    from rlslurm.engines.shared_buffer import MemfdBuffer

    buf = MemfdBuffer(1 << 16)
    while (seed := conn.recv()) is not None:
        data = _buffer(_named(seed))
        buf.tensor[:data.numel()].copy_(data)
        conn.send(buf.source(data.numel()))
    buf.close()


E, I, HM = 2, 4, 3  # experts, expert FFN width, hidden (the MoE loader below)


class MoEish(torch.nn.Module):
    """A loader written like SGLang's FusedMoE at TP > 1: each rank keeps its slice of every expert,
    gate and up stacked into w13 (row slices), down into w2 (a column slice: a strided view of the
    received buffer), one expert per index of a 3-D parameter."""

    def __init__(self, rank: int, tp: int):
        super().__init__()
        self.rank, self.n = rank, I // tp
        self.w13 = torch.nn.Parameter(torch.zeros(E, 2 * self.n, HM))
        self.w2 = torch.nn.Parameter(torch.zeros(E, HM, self.n))

    def load_weights(self, weights):
        for name, w in weights:
            _, e, kind, _ = name.split(".")
            mine = slice(self.rank * self.n, (self.rank + 1) * self.n)
            if kind == "gate_proj":
                self.w13.data[int(e), : self.n].copy_(w[mine])
            elif kind == "up_proj":
                self.w13.data[int(e), self.n:].copy_(w[mine])
            else:
                self.w2.data[int(e)].copy_(w[:, mine])


def _experts(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(f"experts.{e}.{kind}.weight", torch.randn(*shape, generator=g)) for e in range(E)
            for kind, shape in (("gate_proj", (I, HM)), ("up_proj", (I, HM)), ("down_proj", (HM, I)))]


@pytest.mark.parametrize("rank", [0, 1])
def test_each_tp_rank_replays_its_slice_of_every_expert(rank: int) -> None:
    """The receiver on an MoE engine at TP 2 (proven on GPUs with SGLang's own FusedMoE loader:
    bench/results/production-shapes-h100x4.md): each rank learns copies of its own slices, the
    column slice of down_proj included, and a replay lands where its load_weights would."""
    plan = bucket_plan(_experts(1))
    model, receiver = MoEish(rank, 2), _Receiver(MoEish(rank, 2))
    receiver.model = model
    receiver._load(_buffer(_experts(1)), plan)
    cmap = receiver.maps[plan.key()]
    assert cmap.complete, cmap.why
    assert len(cmap.copies) == 3 * E
    receiver._load(_buffer(_experts(2)), plan)
    reference = MoEish(rank, 2)
    reference.load_weights(_experts(2))
    got = _state(model)
    for k, want in _state(reference).items():
        assert torch.equal(got[k], want), k
    mine = slice(rank * (I // 2), (rank + 1) * (I // 2))
    assert torch.equal(got["w2"][1], _experts(2)[5][1][:, mine])  # expert 1's down_proj columns of this rank


R, L = 3, 4  # MLA below: latent rank, heads x their key width


class MLAish(torch.nn.Module):
    """A loader written like SGLang's DeepSeek-V3 (deepseek_common/deepseek_weight_loader.py, 0.5.14 and
    0.5.23): load_weights copies kv_b_proj, then its post_load_weights recomputes the absorbed MLA
    weight w_kc from that parameter (`bind_or_assign`: a copy into the existing tensor, which is no
    parameter). A replay of the bucket's copies alone would leave w_kc at the weights it learnt from."""

    def __init__(self):
        super().__init__()
        self.kv_b = torch.nn.Parameter(torch.zeros(L, R))
        self.w_kc = self.kv_b.data.t().contiguous()

    def load_weights(self, weights):
        for name, w in weights:
            if name == "kv_b_proj.weight":
                self.kv_b.data.copy_(w)
        self.w_kc.copy_(self.kv_b.data.t().contiguous())


def _mla(seed: int) -> list[tuple[str, torch.Tensor]]:
    return [("kv_b_proj.weight", torch.randn(L, R, generator=torch.Generator().manual_seed(seed)))]


def test_state_derived_from_the_weights_keeps_load_weights() -> None:
    """The MLA families' w_kc/w_vc: a parameter read into new memory during load_weights is state a
    replay would not recompute, so the bucket keeps SGLang's load_weights, and the derived tensor
    follows every update (before, the second update left it at the first one's weights)."""
    plan = bucket_plan(_mla(1))
    model = MLAish()
    receiver = _Receiver(model)
    receiver._load(_buffer(_mla(1)), plan)
    receiver._load(_buffer(_mla(2)), plan)
    assert torch.equal(model.w_kc, _mla(2)[0][1].t())
    cmap = receiver.maps[plan.key()]
    assert not cmap.complete and cmap.why.startswith("a parameter read into new memory by contiguous"), cmap.why


class GLMGateish(torch.nn.Module):
    """SGLang 0.5.14's Glm4MoeGate (glm4_moe.py, glm4_moe_lite.py): the router weight, and an fp32 copy
    of it registered as the buffer `_weight_fp32`, made at the first forward and never refreshed."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(2, H, dtype=torch.bfloat16))
        self.register_buffer("_weight_fp32", None, persistent=False)

    def forward(self, x):
        if self._weight_fp32 is None:
            self._weight_fp32 = self.weight.data.to(torch.float32)
        return x @ self._weight_fp32.t()

    def load_weights(self, weights):
        for _, w in weights:
            self.weight.data.copy_(w)


def test_an_update_drops_the_router_weight_cached_at_a_forward() -> None:
    """After each update the engine routes with the new router weight: the receiver drops the cache
    (receiver.STALE_CACHES) so the next forward rebuilds it (before, GLM engines on SGLang 0.5.14
    routed with their starting weights for the whole run)."""
    from rlslurm.engines.receiver import _parse, mapped_payload
    from rlslurm.engines.shared_buffer import MemfdBuffer

    model = GLMGateish()
    receiver = _Receiver(model)
    x = torch.ones(1, H)
    buf = MemfdBuffer(1 << 12)
    try:
        for seed in (1, 2, 3):  # learn, then replay twice
            named = [("mlp.gate.weight", torch.randn(2, H, generator=torch.Generator().manual_seed(seed))
                      .to(torch.bfloat16))]
            data = _buffer(named)
            buf.tensor[:data.numel()].copy_(data)
            obj, buckets = _parse(mapped_payload([bucket_plan(named)], [buf.source(data.numel())]))
            receiver.run_mapped(buckets, obj["sources"])
            assert torch.equal(model(x), x @ named[0][1].float().t()), seed
        assert receiver.maps[bucket_plan(named).key()].complete
    finally:
        buf.close()
