"""Calls to clora's own services on this machine do not go through the environment's HTTP proxy."""

from __future__ import annotations

import socket

import pytest

from clora.loopback import on_this_machine, trust_env

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("url, loopback", [
    ("http://127.0.0.1:8000", True),
    ("http://127.8.9.1", True),
    ("http://[::1]:8000/v1", True),
    ("http://localhost:8000", True),
    ("http://LOCALHOST", True),
    ("http://10.0.0.5:8000", False),
    ("https://serving.example.com/v1", False),
    ("http://0.0.0.0:8000", False),
    ("http://192.0.2.1:8000", False),  # TEST-NET-1: no machine's address
])
def test_on_this_machine(url, loopback):
    assert on_this_machine(url) is loopback and trust_env(url) is not loopback


def test_this_machines_own_network_address_is_on_this_machine():
    """serving.host set to the machine's LAN address: the learner's rollouts go there, not to the proxy."""
    import psutil

    addresses = [a.address for nics in psutil.net_if_addrs().values() for a in nics
                 if a.family == socket.AF_INET and not a.address.startswith("127.")]
    if not addresses:
        pytest.skip("this machine has no IPv4 address but loopback")
    assert on_this_machine(f"http://{addresses[0]}:8000/v1")
