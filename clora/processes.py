"""Stopping a child process the one way every part of clora does: SIGTERM, a grace period, SIGKILL; and
making a child die with its parent.

Used by `clora up`'s supervisor, the embedded broker, the benchmarks and the tests' server handles. Only
the given process is signalled (never a name or a port), and with `group=True` the process group it leads
(a child started with `start_new_session=True`: it and what it forked), so nothing clora did not start is
touched.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
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


def kill_group(pid: int) -> None:
    """SIGKILL to the process group that `pid` leads: what a child started with `start_new_session=True`
    forked and left behind (vLLM's engine core under serving has no parent-death watch of its own). Nothing
    happens when the group is gone, or when `pid` leads none."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def terminate(process: subprocess.Popen, timeout: float, *, on_kill: Callable[[], None] | None = None,
              group: bool = False, tick: Callable[[], None] | None = None) -> int:
    """Stops `process` and returns its exit code: SIGTERM, then SIGKILL if it is still running after
    `timeout` seconds (`on_kill` is called just before, e.g. to say so). A process that already exited
    is only reaped. `group`: `process` leads its own process group (`start_new_session=True`); the
    SIGKILL goes to the whole group, and once `process` has exited whatever is left in its group is killed
    too (the SIGTERM goes to `process` alone: it stops its own helpers in its own order). `tick` is called
    about every 0.1 s while waiting (from the calling thread)."""
    # Reaped here, not before (a child reaped when its exit was noticed may have had its pid reused since:
    # its group is not killed again now; who noticed the exit killed it then).
    ours = process.returncode is None
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while process.poll() is None and (left := deadline - time.monotonic()) > 0:
            try:
                process.wait(left if tick is None else min(left, 0.1))
            except subprocess.TimeoutExpired:
                if tick is not None:
                    tick()
        if process.returncode is None:
            if on_kill is not None:
                on_kill()
            if group:
                kill_group(process.pid)
            process.kill()
            process.wait()
    if group and ours:  # what it left behind (its pid, and so its group id, is not free until reaped here)
        kill_group(process.pid)
    return process.returncode


def descendants(pid: int | None = None) -> list[int]:
    """The processes `pid` (this one by default) started, and theirs, as /proc lists them now (Linux)."""
    out, todo = [], [os.getpid() if pid is None else pid]
    while todo:
        parent = todo.pop()
        try:
            threads = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in threads:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as f:
                    children = [int(c) for c in f.read().split()]
            except OSError:
                continue
            out += children
            todo += children
    return out


def running(pid: int | None) -> bool:
    """Whether a process of that id runs on this host (another user's included)."""
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _started(pid: int) -> str | None:
    """The process's start time (clock ticks since boot), which tells it from a later one given its id."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


WATCH_EVERY_S = 0.5  # how often the watchdog notes its parent's descendants


def _watch_over(parent: int) -> None:
    """The watchdog's body (`outlived_by_none`): notes `parent`'s descendants every WATCH_EVERY_S until its
    stdin has something to read. Data means it was let go (`close_watchdog`); its end, with nothing read,
    means the parent is gone: it then stops each process of the last note that is still the same one (a pid
    reused since is another process): SIGTERM, up to 10 s, SIGKILL."""
    import select
    import sys

    me, given = os.getpid(), []
    while not select.select([sys.stdin], [], [], WATCH_EVERY_S)[0]:
        given = [(pid, started) for pid in descendants(parent) if pid != me and (started := _started(pid)) is not None]
    if sys.stdin.buffer.read():
        return
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 0.0)):
        live = [(pid, started) for pid, started in given if _started(pid) == started]
        for pid, _ in live:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + wait
        while live and time.monotonic() < deadline:
            time.sleep(0.1)
            live = [(pid, started) for pid, started in live if _started(pid) == started]


def outlived_by_none() -> subprocess.Popen | None:
    """A watchdog process that stops this process's children, and theirs, once this process is gone, however
    it went (SIGKILL included, where nothing of ours runs): for children that would outlive it otherwise, as
    vLLM's engine core outlives serving (it watches nothing of its parent) and would hold its memory, and a
    GPU's, for good. It follows them as they come (started before the engine, it covers the engine's long
    start too: a serving killed then left the engine loading on its own). `close_watchdog` lets it go at a
    normal stop, where the caller stops them its own way. None off Linux."""
    if _started(os.getpid()) is None:
        return None
    import sys

    # -P: a module in the current directory never stands in for clora (clora.cli.keep_the_current_directory_off_the_path)
    return subprocess.Popen([sys.executable, "-P", "-c", "import sys; from clora.processes import _watch_over; "
                             "_watch_over(int(sys.argv[1]))", str(os.getpid())],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def close_watchdog(watchdog: subprocess.Popen | None, timeout: float = 5.0) -> None:
    """Lets an `outlived_by_none` watchdog go: it exits and stops nothing."""
    if watchdog is None:
        return
    try:
        watchdog.stdin.write(b"let go")
        watchdog.stdin.close()
        watchdog.wait(timeout)
    except (OSError, subprocess.TimeoutExpired):
        watchdog.kill()
        watchdog.wait()
