"""Calls to services on this machine bypass the environment's HTTP proxy.

httpx and urllib take `http_proxy` / `HTTPS_PROXY` from the environment and bypass them only for hosts
that `NO_PROXY` names. On a host whose proxy is set for outside traffic, a call to 127.0.0.1 would go to the
proxy, which cannot reach this machine's loopback: `clora up` would never see serving healthy, and the
learner's rollouts would fail. Clients of clora's own services ask `trust_env(url)` instead.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit


def is_loopback(url: str) -> bool:
    """Whether `url`'s host is this machine's loopback (127.0.0.0/8, ::1, localhost)."""
    host = (urlsplit(url).hostname or "").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def trust_env(url: str) -> bool:
    """httpx's `trust_env` for calls to `url`: the environment's proxies and certificates, except on
    loopback, where no proxy belongs."""
    return not is_loopback(url)
