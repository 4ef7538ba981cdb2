"""The port picker for children that bind their ports late (peers, the vLLM pair)."""

from __future__ import annotations

from pathlib import Path

from pd_orchestrator.bench import peers


def test_ports_lie_below_the_kernels_own_picks(tmp_path: Path) -> None:
    """A server binds its ports long after start; a port from the kernel's ephemeral
    range could meanwhile be taken by any outgoing connect (a CI run once lost the
    vLLM decoder's KV-events replay port that way)."""
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("32768\t60999\n")
    assert peers._ephemeral_low(range_file) == 32768
    assert peers._ephemeral_low(tmp_path / "missing") == 32768
    low = peers._ephemeral_low()
    ports = [peers.free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(10000 <= port < low for port in ports)
