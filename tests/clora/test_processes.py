"""clora/processes.py: terminate stops a cooperative child with SIGTERM and kills one that ignores it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from clora.processes import terminate

pytestmark = pytest.mark.unit


def start(code: str) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", code + "\nprint('up', flush=True)\nimport time\ntime.sleep(60)"],
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "up"  # its signal handlers are in place
    return process


def test_a_child_that_honours_sigterm_stops_without_a_kill():
    process = start("")
    killed = []
    assert terminate(process, 10, on_kill=lambda: killed.append(True)) == -signal.SIGTERM
    assert killed == []


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace_period():
    process = start("import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)")
    killed = []
    started = time.monotonic()
    assert terminate(process, 0.5, on_kill=lambda: killed.append(True)) == -signal.SIGKILL
    assert killed == [True] and time.monotonic() - started >= 0.5


def test_an_exited_child_is_only_reaped():
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    process.wait()
    assert terminate(process, 1, on_kill=lambda: pytest.fail("nothing to kill")) == 3
