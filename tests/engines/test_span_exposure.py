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
from tests.helpers.config_errors import one_line_naming
from tests.helpers.hf_shape import hf_shaped_dir


@pytest.fixture
def argv(tmp_path: Path, prompts: Path) -> list[str]:
    """qwen3-4B on 2 trainer + 2 rollout nodes of 8 GPUs, one engine over both rollout nodes."""
    return ["--model", "qwen3-4B", "--nodes", "4", "--prompt-data", str(prompts), "--hf-checkpoint",
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


# Every way SGLang 0.5.23 turns attention data parallelism on (engines/sglang_args.py `attention_dp`):
# the refusal follows the value SGLang resolves, not one spelling.
@pytest.mark.parametrize("extra,named", [
    (["--sglang-attn-dp-size", "2"], "--sglang-attn-dp-size 2"),
    (["--sglang-attention-data-parallel-size=2"], "--sglang-attention-data-parallel-size 2"),
    (["--sglang-enable-dp-attention", "--sglang-dp-size", "2"], "--sglang-enable-dp-attention"),
    (["--sglang-attn-dp", "2"], "--sglang-attn-dp 2"),  # argparse's abbreviation of --attn-dp-size
])
def test_attention_dp_by_any_spelling_is_refused(argv: list[str], extra: list[str], named: str) -> None:
    pytest.importorskip("sglang")  # the abbreviation is resolved by the installed SGLang's parser
    one_line_naming(argv + extra, named, "spanning 2 nodes", "--engine-span-interface", "--engine-span-ports-closed")


def test_attention_dp_of_size_one_is_not_refused(argv: list[str]) -> None:
    resolve(argv + ["--sglang-attn-dp-size", "1", "--sglang-attention-data-parallel-size", "2",
                    "--sglang-attn-dp-size=1"])  # argparse keeps the last


def test_a_config_file_is_read_as_sglang_merges_it(argv: list[str], tmp_path: Path, monkeypatch) -> None:
    """--sglang-config FILE: SGLang puts its keys before the command line. Every check applies to them
    (attention DP, the flags rlslurm owns, unknown names), and a flag given on the command line wins."""
    pytest.importorskip("sglang")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dp.yaml").write_text("attn-dp-size: 2\nmem-fraction-static: 0.7\n")
    msg = one_line_naming(argv + ["--sglang-config", "dp.yaml"],
                          f"attn-dp-size: 2 in --sglang-config {tmp_path}/dp.yaml",
                          "spanning 2 nodes")
    cfg = resolve(argv + ["--sglang-config", "dp.yaml", "--sglang-attn-dp-size", "1"]).cfg  # the command line wins
    # absolute: read on the node
    assert cfg.sglang_args == ["--config", str(tmp_path / "dp.yaml"), "--attn-dp-size", "1"], msg
    (tmp_path / "host.yaml").write_text("host: 0.0.0.0\n")
    one_line_naming(argv + ["--sglang-config", "host.yaml"], f"key host of --sglang-config {tmp_path}/host.yaml",
                    "rlslurm sets --host")
    (tmp_path / "typo.yaml").write_text("attn-dp-sze: 2\n")
    one_line_naming(argv + ["--sglang-config", "typo.yaml"], "key attn-dp-sze", "did you mean attn-dp-size")
    (tmp_path / "tp.yaml").write_text("attn-dp-size: 3\n")
    one_line_naming(argv[:-1] + ["8", "--sglang-config", "tp.yaml"], "attn-dp-size: 3", "must divide")
    one_line_naming(argv + ["--sglang-config", "gone.yaml"], f"--sglang-config {tmp_path}/gone.yaml", "no such file")
    (tmp_path / "list.yaml").write_text("- attn-dp-size\n")
    one_line_naming(argv + ["--sglang-config", "list.yaml"], "list.yaml", "mapping")


def test_without_sglang_the_checks_use_the_flags_rlslurm_knows(tmp_path: Path) -> None:
    """A submit host without SGLang (another environment) still refuses what it can name: the
    attention-DP spellings and the owned flags, in a config file too."""
    from rlslurm.engines.sglang_flags import check_owned
    from rlslurm.engines.span import span_exposure_refusal

    (tmp_path / "c.yaml").write_text("attention-data-parallel-size: 4\n")
    for args in (["--attn-dp-size", "2"], ["--config", str(tmp_path / "c.yaml")], ["--dwdp-size=2"],
                 ["--ep-join-mode", "scale"]):
        assert "spanning 2 nodes" in span_exposure_refusal(args, 2, None, False, table=None), args
        assert span_exposure_refusal(args, 2, None, True, table=None) is None
    assert span_exposure_refusal(["--attn-dp-size", "1"], 2, None, False, table=None) is None
    (tmp_path / "k.yaml").write_text("api-key: x\n")
    with pytest.raises(ConfigError, match=r"key api-key of --sglang-config .*k.yaml: rlslurm sets --api-key"):
        check_owned(["--config", str(tmp_path / "k.yaml")])


def test_the_rollout_node_checks_again_with_its_own_sglang(tmp_path: Path) -> None:
    """The node reads the passthrough with its own SGLang's parser before any engine starts
    (rollout/node.py `engine_specs`): a config file changed after submit, or an abbreviation submit
    could not resolve, is refused there with one line."""
    pytest.importorskip("sglang")
    from rlslurm.engines.span import check_on_node

    conf = tmp_path / "c.yaml"
    conf.write_text("mem-fraction-static: 0.7\n")
    check_on_node(["--config", str(conf)], 2, None, False)
    conf.write_text("attn-dp-size: 2\n")  # edited after submit
    with pytest.raises(ConfigError, match="attn-dp-size: 2 in --sglang-config .* spanning 2 nodes"):
        check_on_node(["--config", str(conf)], 2, None, False)
    check_on_node(["--config", str(conf)], 2, "ib0", False)
    with pytest.raises(ConfigError, match="--sglang-attention-data 2 .*spanning 3 nodes"):
        check_on_node(["--attention-data", "2"], 3, None, False)
    with pytest.raises(ConfigError, match="--sglang-hos: rlslurm sets --host"):
        check_on_node(["--hos", "0.0.0.0"], 1, None, False)
