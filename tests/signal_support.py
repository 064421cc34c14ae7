"""For tests of signal handlers: a handler runs in the main thread between two of its bytecodes, perhaps
while that thread holds a lock (threading.Event.wait's), so a handler that takes a non-reentrant lock can
deadlock the loop it should stop."""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator


def locks_taken_by_handler(signum: int = signal.SIGTERM, times: int = 1) -> list[str]:
    """Calls the handler installed for `signum` `times` times under a profiler; returns the non-reentrant
    locks it took (an RLock, logging's, may be taken again by the thread holding it)."""
    taken: list[str] = []

    def profile(_frame, event, arg):
        if event == "c_call" and getattr(arg, "__name__", "") in ("acquire", "__enter__", "acquire_lock") \
                and "RLock" not in repr(arg):
            taken.append(repr(arg))

    handler = signal.getsignal(signum)
    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        for _ in range(times):
            handler(signum, None)
    finally:
        sys.setprofile(previous)
    return taken


@contextlib.contextmanager
def handlers_restored() -> Iterator[None]:
    """Puts SIGTERM's and SIGINT's handlers back as they were after code that installs its own."""
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
