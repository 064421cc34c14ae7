"""Helpers for the tests in tests/clora that start real processes: whether one is gone."""

from __future__ import annotations

import time


def gone(pid: int, within: float = 10.0) -> bool:
    """Whether process `pid` is dead within `within` seconds (a zombie counts: an orphan's reaper may be slow)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False
