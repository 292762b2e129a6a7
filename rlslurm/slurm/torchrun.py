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
"""

from __future__ import annotations

import datetime
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


def main(argv: list[str]) -> None:
    addr, port, node_rank = _opt(argv, "master-addr"), _opt(argv, "master-port"), _opt(argv, "node-rank")
    if addr is None or port is None or node_rank is None:
        raise SystemExit("rlslurm.slurm.torchrun: needs --master-addr=, --master-port= and --node-rank=")
    keep = host_rendezvous_store(addr, int(port)) if int(node_rank) == 0 else None  # noqa: F841 (kept alive)
    from torch.distributed import run

    run.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
