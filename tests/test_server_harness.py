"""The test harness's own helpers (tests/server_harness.py)."""

from __future__ import annotations

from server_harness import free_local_port, free_ports


def test_free_ports_are_all_different():
    # servers started together on ports picked one after another once raced for the same port: a port bound and
    # closed may be handed out again by the next pick (some 1 in 15 of 2,000 picks here repeated an earlier one)
    ports = free_ports(500)
    assert len(set(ports)) == 500 and all(1024 <= p < 65536 for p in ports)
    assert 1024 <= free_local_port() < 65536
