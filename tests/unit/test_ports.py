"""The ports the kit picks for listeners that bind later: outside the kernel's ephemeral range
(where every connection's source port comes from) and above Ray's worker ports, never one that
something holds; and a "port still taken" failure names who holds it."""

from __future__ import annotations

import os
import socket

import pytest

from rayfleet.commands import host
from rayfleet.facts import RAY_PORTS_BY_NAME


def test_picked_ports_are_outside_the_ephemeral_range_and_free(tmp_path):
    ranges = tmp_path / "ip_local_port_range"
    # Ray's worker ports end just below; Serve's direct ingress ports are never picked.
    direct = RAY_PORTS_BY_NAME["serve-direct-ingress"]
    assert host.PICK_FROM == RAY_PORTS_BY_NAME["worker-ports"].to_port + 1
    ranges.write_text(f"{direct.to_port + 1}\t64000\n")
    assert host.pickable(ranges) == [p for p in range(host.PICK_FROM, direct.to_port + 1)
                                     if p < direct.from_port] + list(range(64001, 65536))
    assert host.ephemeral_range(tmp_path / "missing") == (32768, 60999)
    # This machine's own range: no pick falls in it, nor among Ray's worker ports.
    low, high = host.ephemeral_range()
    picked = host.free_ports(50)
    assert len(set(picked)) == 50
    assert all(p >= host.PICK_FROM and not low <= p <= high for p in picked), picked


def test_a_held_port_is_never_picked_and_its_holder_is_named():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(OSError, match="fewer than 1 free ports"):
            host.free_ports(1, candidates=[port])
        assert f"{os.getpid()} " in " ".join(h + " " for h in host.port_holders(port))
    assert host.port_holders(port) == []
