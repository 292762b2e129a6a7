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


def _context():
    """A real PContext whose `_close` (what `close` calls with the timeout it settled on) records."""
    from torch.distributed.elastic.multiprocessing.api import PContext

    class Recording(PContext):
        def _close(self, death_sig, timeout: int = 30) -> None:
            self.closed.append((death_sig, timeout))

        _start = _poll = pids = None  # abstract there, unused here

    ctx = Recording.__new__(Recording)  # only what close() touches
    ctx.closed, ctx._tail_logs, ctx.filtered_stdout, ctx.filtered_stderr = [], [], None, None
    return ctx


def test_an_older_torch_gets_the_timeout_in_process(monkeypatch) -> None:
    """torch 2.11: no flag (torchrun would refuse it), and on a TERM the agent's
    `_shutdown(death_sig)` (no timeout parameter there) calls `PContext.close(death_sig)`, i.e. 30 s."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import PContext

    monkeypatch.setattr(PContext, "close", PContext.close)  # undone after the test
    argv = torchrun.shutdown_timeout_argv(ARGV, native=False)
    assert argv == [a for a in ARGV if not a.startswith("--shutdown-timeout")]
    ctx = _context()
    ctx.close(signal.SIGTERM)  # torch 2.11's LocalElasticAgent._shutdown(death_sig)
    ctx.close(signal.SIGTERM, timeout=600)  # a longer one asked for stays longer
    assert ctx.closed == [(signal.SIGTERM, 300), (signal.SIGTERM, 600)]
    agent = LocalElasticAgent.__new__(LocalElasticAgent)  # this torch's agent: _shutdown(sig, timeout=30)
    agent._worker_watchdog = agent._health_check_server = None
    agent._pcontext = ctx
    agent._shutdown(signal.SIGTERM)
    assert ctx.closed[-1] == (signal.SIGTERM, 300)
    torchrun.shutdown_timeout_argv(ARGV, native=False)  # applied twice (one process, one agent): not stacked
    ctx.close(signal.SIGTERM)
    assert ctx.closed[-1] == (signal.SIGTERM, 300)


@pytest.mark.parametrize("bad", ["--shutdown-timeout=soon", "--shutdown-timeout=-1"])
def test_a_bad_timeout_is_one_line_naming_the_flag(bad: str) -> None:
    with pytest.raises(SystemExit, match="--shutdown-timeout="):
        torchrun.shutdown_timeout_argv([bad, "x.py"], native=False)
