"""One port policy (rlslurm/net.py): engines from 20000 up to the ephemeral range, trainer rendezvous
stores (`rlslurm run`, the converter, the batch script) below them, so neither takes the other's."""

from __future__ import annotations

import socket

from rlslurm.net import RENDEZVOUS_PORTS, allocate_ports, ephemeral_range, free_port, rendezvous_port


def test_rendezvous_ports_lie_below_the_engines_and_are_free() -> None:
    lo, hi = RENDEZVOUS_PORTS
    port = rendezvous_port("127.0.0.1")
    assert lo <= port < hi <= free_port("127.0.0.1") < ephemeral_range()[0]
    with socket.socket() as s:  # free right now
        s.bind(("127.0.0.1", port))


def test_an_allocation_is_distinct_and_in_its_range() -> None:
    ports = allocate_ports("127.0.0.1", 20, port_range=RENDEZVOUS_PORTS)
    assert len(set(ports)) == 20 and all(RENDEZVOUS_PORTS[0] <= p < RENDEZVOUS_PORTS[1] for p in ports)


def test_the_batch_script_picks_its_rendezvous_port_in_the_same_range() -> None:
    from pathlib import Path

    template = (Path(__file__).resolve().parents[2] / "rlslurm/templates/hetjob.sbatch.j2").read_text()
    lo, hi = RENDEZVOUS_PORTS
    assert f"TRAINER_PORT=$(( {lo} + (SLURM_JOB_ID * 131 + ATTEMPT * 17) % {hi - lo} ))" in template
