"""Which trainer rank serves which engine rank under --colocate's IPC transport (rlslurm/trainer/weights/ipc.py
`assign`): on GPUs the rank on the engine rank's own GPU of the same node, whatever the order of the
records; on CPU the node's engine ranks dealt round robin to its trainer ranks; an engine spanning nodes
has each TP rank served on its own node; an engine rank with no trainer rank on its GPU or node is a
one-line error naming it."""

from __future__ import annotations

import pytest

from rlslurm.engines.fanout import EngineTarget
from rlslurm.errors import ConfigError
from rlslurm.trainer.weights.ipc import Found, Server, assign


def _engine(url: str, node: str | tuple[str, ...], gpus: tuple[int, ...], ranks: int = 1) -> Found:
    nodes = (node,) if isinstance(node, str) else node
    return Found(EngineTarget(url=url, ranks=max(ranks, len(gpus) * len(nodes), len(nodes)), pid=None, restarts=0),
                 nodes, gpus)


def test_gpu_engines_are_served_by_the_rank_on_each_of_their_gpus() -> None:
    # two nodes of 4 GPUs; trainer ranks numbered node-major, local rank = GPU
    servers = [Server(n * 4 + g, f"n{n}", g, g) for n in range(2) for g in range(4)]
    engines = [_engine("b", "n1", (2, 3)), _engine("a", "n0", (0, 1)), _engine("c", "n0", (2,)),
               _engine("d", "n0", (3,))]
    assert assign(engines, servers) == [[6, 7], [0, 1], [2], [3]]
    with pytest.raises(ConfigError, match=r"TP rank 1 of engine e is on GPU 4 of n0, where no trainer rank runs"):
        assign([_engine("e", "n0", (3, 4))], servers)
    with pytest.raises(ConfigError, match=r"TP rank 0 of engine f runs on node 'n9', where no trainer rank runs"):
        assign([_engine("f", "n9", (0,))], servers)


def test_cpu_engine_ranks_are_dealt_round_robin_per_node() -> None:
    servers = [Server(0, "n0", None, 0), Server(1, "n0", None, 1), Server(2, "n1", None, 0)]
    engines = [_engine("a", "n0", ()), _engine("b", "n0", ()), _engine("c", "n0", ()), _engine("d", "n1", (), 2)]
    assert assign(engines, servers) == [[0], [1], [0], [2, 2]]


def test_an_engine_spanning_nodes_is_served_on_each_of_its_nodes() -> None:
    """SGLang numbers a spanning engine's TP ranks node by node: TP=8 over n1, n0 (node rank order) with
    4 GPUs each puts ranks 0-3 on n1's GPUs 0-3 and 4-7 on n0's; on CPU one rank per node."""
    servers = [Server(n * 4 + g, f"n{n}", g, g) for n in range(2) for g in range(4)]
    assert assign([_engine("a", ("n1", "n0"), (0, 1, 2, 3))], servers) == [[4, 5, 6, 7, 0, 1, 2, 3]]
    assert assign([_engine("b", ("n0", "n1"), (2, 3))], servers) == [[2, 3, 6, 7]]
    with pytest.raises(ConfigError, match=r"TP rank 2 of engine c runs on node 'n5'"):
        assign([_engine("c", ("n0", "n5"), (0, 1))], servers)
    cpu = [Server(0, "n0", None, 0), Server(1, "n1", None, 0), Server(2, "n1", None, 1)]
    assert assign([_engine("d", ("n1", "n0"), ()), _engine("e", ("n0", "n1"), ())], [*cpu]) == [[1, 0], [0, 2]]
