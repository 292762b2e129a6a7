"""torchrun's wait between the TERM it forwards and its KILL is the run's --signal-grace-s, on a torch
whose torchrun takes --shutdown-timeout (>= 2.13) and on one whose agent hard-codes 30 s (2.11):
rlslurm/slurm/torchrun.py. The real TERM save under torchrun: tests/trainer/test_term_save.py."""

from __future__ import annotations

import signal

import pytest

from rlslurm.attempt import trainer_argv
from rlslurm.slurm import torchrun

ARGV = ["--nnodes=1", "--node-rank=0", "--master-addr=127.0.0.1", "--master-port=15001", "--shutdown-timeout=300",
        "-m", "rlslurm.trainer.main", "--run-dir", "RUN"]


def test_the_trainer_command_carries_the_signal_grace() -> None:
    argv = trainer_argv("RUN", nnodes=1, node_rank=0, procs_per_node=2, master_addr="a", master_port=1,
                        shutdown_timeout_s=420)
    assert "--shutdown-timeout=420" in argv
    assert argv.index("--shutdown-timeout=420") < argv.index("rlslurm.trainer.main")  # torchrun's, not the trainer's


def test_a_torch_that_takes_the_flag_gets_it() -> None:
    if not torchrun.torch_has_shutdown_timeout():
        pytest.skip("this torch has no --shutdown-timeout (the in-process path is tested below)")
    from torch.distributed.run import get_args_parser

    assert torchrun.shutdown_timeout_argv(ARGV) == ARGV
    assert get_args_parser().parse_args(ARGV[:-4] + ["x.py"]).shutdown_timeout == 300


class _Context:
    def __init__(self) -> None:
        self.closed: list[tuple[signal.Signals, int]] = []

    def close(self, death_sig: signal.Signals, timeout: int) -> None:
        self.closed.append((death_sig, timeout))


def test_an_older_torch_gets_the_timeout_in_process(monkeypatch) -> None:
    """torch 2.11: no flag (torchrun would refuse it), and `SimpleElasticAgent.run` shuts the workers
    down on a TERM with `_shutdown(sigval)`, i.e. LocalElasticAgent's default of 30 s."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    monkeypatch.setattr(LocalElasticAgent, "_shutdown", LocalElasticAgent._shutdown)  # undone after the test
    argv = torchrun.shutdown_timeout_argv(ARGV, native=False)
    assert argv == [a for a in ARGV if not a.startswith("--shutdown-timeout")]
    agent = LocalElasticAgent.__new__(LocalElasticAgent)  # only what _shutdown touches
    agent._worker_watchdog = agent._health_check_server = None
    agent._pcontext = ctx = _Context()
    agent._shutdown(signal.SIGTERM)  # as the agent calls it on a TERM in torch 2.11
    agent._shutdown(signal.SIGTERM, timeout=600)  # a longer one asked for stays longer
    assert ctx.closed == [(signal.SIGTERM, 300), (signal.SIGTERM, 600)]
    torchrun.shutdown_timeout_argv(ARGV, native=False)  # applied twice (one process, one agent): not stacked
    agent._shutdown(signal.SIGTERM)
    assert ctx.closed[-1] == (signal.SIGTERM, 300)


@pytest.mark.parametrize("bad", ["--shutdown-timeout=soon", "--shutdown-timeout=-1"])
def test_a_bad_timeout_is_one_line_naming_the_flag(bad: str) -> None:
    with pytest.raises(SystemExit, match="--shutdown-timeout="):
        torchrun.shutdown_timeout_argv([bad, "x.py"], native=False)
