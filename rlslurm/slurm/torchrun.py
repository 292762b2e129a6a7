"""`python -m rlslurm.slurm.torchrun ARGS`: torchrun whose rendezvous store listens on the master
address only.

torchrun's static rendezvous (`--master-addr/--master-port`, torch 2.13
elastic/rendezvous/static_tcp_rendezvous.py) hosts a TCPStore on node rank 0 that binds every
interface (`::`, measured: docs/security.md) and has no authentication. torch has no option to
bind an address, but it creates that store with `multi_tenant=True`, which reuses a TCPStore
server the same process already runs on that port. So node rank 0 first hosts one itself, on a
socket bound to the master address (`master_listen_fd`), and then runs torchrun in-process:
the rendezvous, the agent's store and the trainer ranks' default group (clients of the agent
store) all use it. If the master address is not one of this node's (a NAT'd or alias name),
torchrun's own wildcard store is used, with a warning.

`--shutdown-timeout=S`: how long torchrun waits for its workers after it forwards a TERM before it
KILLs them. torch's default is 30 s, shorter than a real model's checkpoint on TERM; rlslurm passes
the run's --signal-grace-s (rlslurm/attempt.py `trainer_argv`), so SLURM's own KILL (KillWait or the
partition's GraceTime), not torchrun's, bounds the save. torch >= 2.13 takes the flag itself (its
LaunchConfig has `shutdown_timeout`); older torch (2.11 in the GPU image) has the 30 s as the
default argument of the workers' `PContext.close` and no way to set it, so there the flag is taken off
the command line and that default is raised in-process (`apply_shutdown_timeout`;
docs/slurm-preemption.md, "torchrun's own KILL").
"""

from __future__ import annotations

import datetime
import functools
import signal
import sys

# The store outlives every timeout of the job's own: torchrun sets the real ones per operation.
STORE_TIMEOUT = datetime.timedelta(hours=2)


def _opt(argv: list[str], name: str) -> str | None:
    for a in argv:
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
    return None


def host_rendezvous_store(addr: str, port: int):
    """Node rank 0: the TCPStore server torchrun's rendezvous will reuse, bound to `addr` only.
    Returns it (keep it referenced: torch holds the cached server weakly) or None if `addr` is not
    an address of this node."""
    import torch.distributed as dist

    from rlslurm.net import bound_socket

    try:
        sock = bound_socket(addr, port)
    except OSError as e:
        print(f"rlslurm.slurm.torchrun: cannot bind the rendezvous store to {addr}:{port} ({e}); "
              f"torchrun's store listens on every interface", file=sys.stderr, flush=True)
        return None
    try:
        store = dist.TCPStore(addr, port, None, True, STORE_TIMEOUT, wait_for_workers=False, multi_tenant=True,
                              master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # torch owns the fd now and closes it with the store
    return store


SHUTDOWN_TIMEOUT = "shutdown-timeout"


def torch_has_shutdown_timeout() -> bool:
    """Does this torch's torchrun take --shutdown-timeout (torch >= 2.13: LaunchConfig.shutdown_timeout)?"""
    from torch.distributed.launcher.api import LaunchConfig

    return "shutdown_timeout" in getattr(LaunchConfig, "__dataclass_fields__", {})


def apply_shutdown_timeout(seconds: int) -> None:
    """For a torch without --shutdown-timeout: every close of the workers' process context waits at
    least `seconds` for them before the KILL. `PContext.close(death_sig, timeout=30)` is where every
    torch version's agent stops its workers; torch 2.11's `LocalElasticAgent._shutdown(death_sig)`
    takes no timeout at all and calls it with the default (measured on the GPU image: wrapping
    `_shutdown` with a timeout argument raised TypeError there, docs/slurm-preemption.md)."""
    from torch.distributed.elastic.multiprocessing.api import PContext

    original = PContext.close
    if getattr(original, "rlslurm_timeout", None) is not None:
        original = original.__wrapped__

    @functools.wraps(original)
    def close(self, death_sig: signal.Signals | None = None, timeout: int = 30) -> None:
        return original(self, death_sig, max(timeout, seconds))

    close.rlslurm_timeout = seconds  # type: ignore[attr-defined]
    PContext.close = close  # type: ignore[method-assign]


def shutdown_timeout_argv(argv: list[str], native: bool | None = None) -> list[str]:
    """torchrun's argv with our --shutdown-timeout= handled: left for a torch that takes it, else
    taken off and applied in-process."""
    value = _opt(argv, SHUTDOWN_TIMEOUT)
    if value is None:
        return argv
    try:
        seconds = int(value)
        if seconds < 0:
            raise ValueError
    except ValueError:
        raise SystemExit(f"rlslurm.slurm.torchrun: --{SHUTDOWN_TIMEOUT}={value}: not a whole number of seconds >= 0")
    if native if native is not None else torch_has_shutdown_timeout():
        return argv
    apply_shutdown_timeout(seconds)
    return [a for a in argv if not a.startswith(f"--{SHUTDOWN_TIMEOUT}=")]


def main(argv: list[str]) -> None:
    addr, port, node_rank = _opt(argv, "master-addr"), _opt(argv, "master-port"), _opt(argv, "node-rank")
    if addr is None or port is None or node_rank is None:
        raise SystemExit("rlslurm.slurm.torchrun: needs --master-addr=, --master-port= and --node-rank=")
    argv = shutdown_timeout_argv(argv)
    keep = host_rendezvous_store(addr, int(port)) if int(node_rank) == 0 else None  # noqa: F841 (kept alive)
    from torch.distributed import run

    run.main(argv)


if __name__ == "__main__":
    from rlslurm.exit_guard import skip_final_gc_at_exit

    skip_final_gc_at_exit()  # the agent has torch loaded: ~0.6 s of a core at its exit otherwise
    main(sys.argv[1:])
