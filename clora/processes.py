"""Stopping a child process the one way every part of clora does: SIGTERM, a grace period, SIGKILL; and
making a child die with its parent.

Used by `clora up`'s supervisor, the embedded broker, the benchmarks and the tests' server handles. Only
the given process is signalled (never a name or a port), so nothing clora did not start is touched.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def _load_prctl():
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None  # not Linux: children may outlive a killed parent, as with any plain subprocess


# Looked up here, in the parent: loading a library between fork and exec can deadlock on a lock another
# thread of the parent held at the fork.
_PRCTL = _load_prctl()


def die_with_parent() -> Callable[[], None]:
    """A `preexec_fn` for a child that must not outlive the process starting it (Linux parent-death signal:
    SIGTERM when the thread that started it exits, so start such children from a thread that lives as long
    as they do). Call it in the parent: `preexec_fn=die_with_parent()`."""
    parent = os.getpid()

    def in_child() -> None:
        if _PRCTL is None:
            return
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died between the fork and the prctl: no signal will come
            os._exit(1)

    return in_child


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
