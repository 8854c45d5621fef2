"""free_port picks ports the kernel never hands out on its own, so a port chosen for a child process is
still free when the child binds it seconds later (CI saw a worker's metrics port taken in between)."""

from __future__ import annotations

import socket

from splitserve.common.serving import ephemeral_port_range, free_port


def test_free_ports_are_outside_the_ephemeral_range_and_bindable():
    low, high = ephemeral_port_range()
    ports = {free_port() for _ in range(50)}
    assert all(not low <= p <= high for p in ports), sorted(ports)
    assert len(ports) > 40  # random, not one port over and over
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))


def test_a_taken_port_is_not_given():
    with socket.socket() as held:
        held.bind(("127.0.0.1", free_port()))
        taken = held.getsockname()[1]
        assert all(free_port() != taken for _ in range(200))
