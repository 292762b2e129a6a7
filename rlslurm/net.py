"""Addresses and ports of the processes one node runs.

`node_ip()` is the node's cluster address as an IP *literal*: servers bind to it and it is
written into the run directory's control files for other nodes to dial. A hostname is never
used, because on clusters the short hostname often resolves to 127.0.1.1 (Debian's /etc/hosts)
or to a management interface that the other nodes cannot reach.

How it is chosen, first match wins:
1. `RLSLURM_NODE_IP` (must be an IP literal; set it when the default pick is the wrong network);
2. with `RLSLURM_ROUTE_PROBE=<IP>` (e.g. the slurmctld's address): the source address the
   kernel would use to reach it, i.e. the interface the cluster network really uses;
3. the first non-loopback IPv4 that `getaddrinfo(gethostname())` returns;
4. `127.0.0.1`, only meaningful for a single-node run.

Ports: `free_port` and `allocate_ports` pick ports from 20000 up to the kernel's ephemeral range
(outbound connections then never steal them between the pick and the server's bind; the batch
script's trainer rendezvous port lies below 20000, so no engine takes it) and hold
every probe socket open until the whole block is chosen, so one allocation never hands out
the same port twice. Another process can still take a port before our server binds it; the
servers then fail at start with EADDRINUSE and the supervisor reports it.
"""

from __future__ import annotations

import ipaddress
import os
import random
import socket
from dataclasses import dataclass

from rlslurm.errors import ConfigError

ENV_NODE_IP = "RLSLURM_NODE_IP"
ENV_ROUTE_PROBE = "RLSLURM_ROUTE_PROBE"
_LOW_PORT = 20000
# A trainer rendezvous store (torchrun's, the checkpoint converter's): below the engines' ports, the
# range the batch script picks its rendezvous port from, so an engine never takes it first.
RENDEZVOUS_PORTS = (15000, _LOW_PORT)


def check_ip_literal(value: str, *, where: str) -> str:
    """Return `value` normalised if it is an IPv4/IPv6 literal, else raise ConfigError naming `where`."""
    try:
        ip = ipaddress.ip_address(value.strip())
    except ValueError:
        raise ConfigError(f"{where}: {value!r} is not an IP address literal (a hostname is not accepted: "
                          f"it may resolve differently on other nodes)") from None
    if ip.is_unspecified:
        raise ConfigError(f"{where}: {value!r} is a wildcard address; give the address other processes dial")
    return str(ip)


def _route_source(target: str) -> str | None:
    """The local address the kernel would use to reach `target` (UDP connect sends nothing)."""
    try:
        family = socket.AF_INET6 if ":" in target else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def _hostname_ipv4() -> str | None:
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
    except OSError:
        return None
    for *_, sockaddr in infos:
        if not ipaddress.ip_address(sockaddr[0]).is_loopback:
            return sockaddr[0]
    return None


def node_ip() -> str:
    """This node's cluster IP literal (see the module docstring for how it is chosen)."""
    if (v := os.environ.get(ENV_NODE_IP)):
        return check_ip_literal(v, where=f"${ENV_NODE_IP}")
    if (probe := os.environ.get(ENV_ROUTE_PROBE)):
        target = check_ip_literal(probe, where=f"${ENV_ROUTE_PROBE}")
        if (src := _route_source(target)):
            return src
    return _hostname_ipv4() or "127.0.0.1"


def ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
            return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _try_bind(host: str, port: int) -> socket.socket | None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        # Wildcard bind: SGLang's TCPStore (the nccl port) listens on all interfaces, so a port
        # taken on any address would fail it.
        s.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
        return s
    except OSError:
        s.close()
        return None


def allocate_ports(host: str, count: int, *, rng: random.Random | None = None,
                   port_range: tuple[int, int] | None = None) -> list[int]:
    """`count` distinct ports that are free on `host` right now, in `port_range` (default: from 20000 to
    the ephemeral range)."""
    if count < 1:
        raise ConfigError(f"port count must be >= 1, got {count}")
    host = check_ip_literal(host, where="port allocation host")
    lo, hi = port_range or (_LOW_PORT, ephemeral_range()[0])
    if hi - lo < count:
        lo, hi = 1024, 65536
    rng = rng or random.Random()
    # Random start: two allocators on one node (two jobs, two test sessions) rarely probe the same ports.
    start = rng.randrange(lo, hi)
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        for i in range(hi - lo):
            port = lo + (start - lo + i) % (hi - lo)
            if (s := _try_bind(host, port)) is not None:
                held.append(s)
                ports.append(port)
                if len(ports) == count:
                    return ports
        # not the user's error (a UserError ends the job for good): another node may have ports
        raise OSError(f"could not find {count} free ports on {host} in {lo}-{hi}")
    finally:
        for s in held:
            s.close()


def bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host`:`port` (an address of this node), not yet listening: for
    torch's TCPStore(master_listen_fd=...), which otherwise binds every interface (`::`, measured
    with torch 2.13, docs/security.md). SO_REUSEADDR as torch sets it: a port whose previous
    store left TIME_WAIT connections is free again. Raises OSError when no address of `host` binds."""
    err: OSError | None = None
    for family, kind, proto, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        s = socket.socket(family, kind, proto)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)
            return s
        except OSError as e:
            s.close()
            err = e
    raise err or OSError(f"{host}: no address to bind")


def consecutive_ports(host: str, count: int, *, tries: int = 200, rng: random.Random | None = None) -> int:
    """The first of `count` consecutive ports free on `host` right now (from 20000 to the ephemeral
    range): for a server that derives ports from the one it is given (SGLang's --dist-init-addr)."""
    host = check_ip_literal(host, where="port allocation host")
    lo, hi = _LOW_PORT, ephemeral_range()[0]
    rng = rng or random.Random()
    for _ in range(tries):
        start = rng.randrange(lo, hi - count)
        held: list[socket.socket] = []
        try:
            for port in range(start, start + count):
                s = _try_bind(host, port)
                if s is None:
                    break
                held.append(s)
            else:
                return start
        finally:
            for s in held:
                s.close()
    raise OSError(f"could not find {count} consecutive free ports on {host} in {lo}-{hi}")


def free_port(host: str = "127.0.0.1") -> int:
    return allocate_ports(host, 1)[0]


def rendezvous_port(host: str = "127.0.0.1") -> int:
    """A port for a trainer rendezvous store on this node (RENDEZVOUS_PORTS)."""
    return allocate_ports(host, 1, port_range=RENDEZVOUS_PORTS)[0]


@dataclass(frozen=True)
class EnginePorts:
    port: int        # HTTP (--port)
    nccl_port: int   # torch.distributed store of the engine's own TP group (--nccl-port)


def engine_port_block(host: str, n_engines: int) -> list[EnginePorts]:
    """Collision-free (port, nccl_port) pairs for `n_engines` engines on this node."""
    ports = allocate_ports(host, 2 * n_engines)
    return [EnginePorts(ports[2 * i], ports[2 * i + 1]) for i in range(n_engines)]


def interface_ipv4(name: str, *, where: str) -> str:
    """The IPv4 address of network interface `name` on this node (SIOCGIFADDR); a ConfigError naming
    `where` (the flag) and the interfaces this node has when it has none."""
    import fcntl
    import struct

    have = sorted(n for _, n in socket.if_nameindex())
    if name not in have:
        raise ConfigError(f"{where} {name}: no such interface on {socket.gethostname()} (it has: {', '.join(have)})")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
        except OSError:
            raise ConfigError(f"{where} {name}: the interface has no IPv4 address on {socket.gethostname()}") from None
    return socket.inet_ntoa(packed[20:24])
