"""Which local addresses listen on a TCP port, read from /proc/net/tcp{,6} (Linux, like SLURM)."""

from __future__ import annotations

import socket


def listening_addresses(port: int) -> list[str]:
    """Sorted local addresses of the sockets in LISTEN state on `port` ('::' / '0.0.0.0' = every interface)."""
    out: list[str] = []
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            with open(path) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            addr_hex, port_hex = fields[1].split(":")
            if fields[3] != "0A" or int(port_hex, 16) != port:  # 0A: TCP_LISTEN
                continue
            raw = bytes.fromhex(addr_hex)
            # the kernel prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            out.append(socket.inet_ntop(family, raw))
    return sorted(out)


if __name__ == "__main__":  # run by torchrun in tests/launcher/test_listeners.py: one line per rank
    import os

    port = int(os.environ["MASTER_PORT"])
    line = f"rank {os.environ['RANK']} rendezvous {port} listens on {listening_addresses(port)}\n"
    # one write(2) of the whole line: both ranks share the pipe, and print() may write the text and its
    # newline separately (the lines came out interleaved once in a full CI run)
    os.write(1, line.encode())
