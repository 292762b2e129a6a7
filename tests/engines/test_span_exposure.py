"""An engine spanning nodes with DP attention talks between its nodes over SGLang ZMQ ports that run
pickled objects from whoever connects (rlslurm/engines/span.py, docs/security.md): refused at submit
unless the user names the interface those ports bind or states that they are closed; with the
interface named, rank 0 meets its ranks (and SGLang binds) on that interface's address."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlslurm.buffer import Control, RunDir
from rlslurm.engines.engine import EngineSpec
from rlslurm.engines.span import SpanLeader
from rlslurm.errors import ConfigError
from rlslurm.net import interface_ipv4
from rlslurm.resolve import resolve
from tests.config_errors import one_line_naming
from tests.hf_shape import hf_shaped_dir
from tests.prompt_files import prompt_lines


@pytest.fixture
def argv(tmp_path: Path) -> list[str]:
    """qwen3-4B on 2 trainer + 2 rollout nodes of 8 GPUs, one engine over both rollout nodes."""
    p = tmp_path / "train.jsonl"
    p.write_text(prompt_lines(*({"prompt": f"say {c}", "label": c} for c in "abcd")))
    return ["--model", "qwen3-4B", "--nodes", "4", "--prompt-data", str(p), "--hf-checkpoint",
            str(hf_shaped_dir(tmp_path / "hf", "qwen3-4B")), "--rollout-num-gpus-per-engine", "16"]


def test_dp_attention_over_nodes_is_refused_naming_both_ways_out(argv: list[str]) -> None:
    msg = one_line_naming(argv + ["--sglang-enable-dp-attention", "--sglang-dp-size", "2"],
                          "--sglang-enable-dp-attention", "--engine-span-interface", "--engine-span-ports-closed",
                          "docs/security.md")
    assert "spanning 2 nodes" in msg


@pytest.mark.parametrize("extra", [["--engine-span-interface", "ib0"], ["--engine-span-ports-closed"]])
def test_either_way_out_is_accepted(argv: list[str], extra: list[str]) -> None:
    cfg = resolve(argv + ["--sglang-enable-dp-attention", "--sglang-dp-size", "2", *extra]).cfg
    assert cfg.rollout.engine_span_interface in (None, "ib0")


def test_what_opens_no_such_port_is_not_refused(argv: list[str], tmp_path: Path) -> None:
    resolve(argv)  # spanning without DP attention: no ZMQ over TCP
    one_node = argv[:-1] + ["8", "--sglang-enable-dp-attention", "--sglang-dp-size", "2"]
    resolve(one_node)  # DP attention inside one node: 127.0.0.1 only


def test_the_ranks_meet_on_the_named_interface(tmp_path: Path) -> None:
    control = Control(RunDir.create(tmp_path / "run"))
    spec = EngineSpec(name="engine-0-0", model_path="m", host="10.9.8.7", port=30000, nccl_port=30001,
                      log_path=tmp_path / "e.log", tp_size=2, nnodes=2, node_rank=0, device="cpu")
    lo = interface_ipv4("lo", where="--engine-span-interface")
    started = SpanLeader(control, attempt=0, bind_host=lo).prepare(spec)
    assert started.dist_init_addr.startswith(f"{lo}:")  # SGLang's ZMQ endpoints derive from this host
    assert control.span("engine-0-0").dist_init_addr == started.dist_init_addr
    with pytest.raises(ConfigError, match=r"--engine-span-interface nope9: no such interface on .*\(it has: .*lo"):
        interface_ipv4("nope9", where="--engine-span-interface")
