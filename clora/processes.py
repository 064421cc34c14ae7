"""Stopping a child process the one way every part of clora does: SIGTERM, a grace period, SIGKILL.

Used by `clora up`'s supervisor, the embedded broker, the benchmarks and the tests' server handles. Only
the given process is signalled (never a name or a port), so nothing clora did not start is touched.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable


def terminate(process: subprocess.Popen, timeout: float, *, on_kill: Callable[[], None] | None = None) -> int:
    """Stops `process` and returns its exit code: SIGTERM, then SIGKILL if it is still running after
    `timeout` seconds (`on_kill` is called just before, e.g. to say so). A process that already exited
    is only reaped."""
    if process.poll() is not None:
        return process.returncode
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        if on_kill is not None:
            on_kill()
        process.kill()
        return process.wait()
