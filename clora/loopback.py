"""Calls to services on this machine bypass the environment's HTTP proxy.

httpx and urllib take `http_proxy` / `HTTPS_PROXY` from the environment and bypass them only for hosts
that `NO_PROXY` names. On a host whose proxy is set for outside traffic, a call to 127.0.0.1 (or to this
machine's own LAN address, where serving listens on it) would go to the proxy, which cannot reach it:
`clora up` would never see serving healthy, and the learner's rollouts would fail. Clients of clora's own
services ask `trust_env(url)` instead.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit


def on_this_machine(url: str) -> bool:
    """Whether `url`'s host is this machine: loopback (127.0.0.0/8, ::1, localhost), or an address of one of
    its interfaces (one a socket can bind). Other host names are not resolved: they count as elsewhere."""
    host = (urlsplit(url).hostname or "").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if address.is_loopback:
        return True
    if address.is_unspecified or address.is_multicast:
        return False
    with socket.socket(socket.AF_INET6 if address.version == 6 else socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, 0))
        except OSError:  # not an address of this machine
            return False
    return True


def trust_env(url: str) -> bool:
    """httpx's `trust_env` for calls to `url`: the environment's proxies and certificates, except for this
    machine, where no proxy belongs."""
    return not on_this_machine(url)
