"""clora/processes.py: terminate stops a cooperative child with SIGTERM and kills one that ignores it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from process_support import gone

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


@pytest.mark.parametrize("honours_sigterm", [False, True])
def test_a_group_stop_takes_what_the_child_forked(tmp_path, honours_sigterm):
    """serving's vLLM engine core is a forked helper with no parent-death watch: killed with its parent (the
    SIGKILL after the grace period), or left behind by one that stopped, it must not outlive it."""
    import os

    helper = tmp_path / "helper.pid"
    code = (f"import subprocess, signal, sys\nh = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            f"open({str(helper)!r}, 'w').write(str(h.pid))\n"
            + ("" if honours_sigterm else "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"))
    process = subprocess.Popen([sys.executable, "-c", code + "print('up', flush=True)\nimport time\ntime.sleep(60)"],
                               stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert process.stdout.readline().strip() == "up"
    pid = int(helper.read_text())
    try:
        expected = -signal.SIGTERM if honours_sigterm else -signal.SIGKILL
        assert terminate(process, 0.5, group=True) == expected
        assert gone(pid), "the forked helper outlived its parent"
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_tick_runs_while_waiting():
    process = start("import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)")
    ticks = []
    terminate(process, 0.6, tick=lambda: ticks.append(time.monotonic()))
    assert len(ticks) >= 3


@pytest.mark.parametrize("helper_ignores_sigterm", [False, True])
def test_children_with_no_parent_death_watch_are_stopped_when_their_parent_is_killed(tmp_path, helper_ignores_sigterm):
    """vLLM's engine core outlived a serving process killed with SIGKILL (outside `clora up`, which kills the
    group), holding the model's memory for good. The watchdog, started before them, stops such children
    once their parent is gone (also one started after it: the engine's long start was not covered), and
    stops nothing when the parent lets it go at a normal stop."""
    import os

    helper = tmp_path / "helper.pid"
    ignore = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); " if helper_ignores_sigterm else ""
    code = (f"import subprocess, sys\nfrom clora.processes import close_watchdog, outlived_by_none\n"
            f"w = outlived_by_none()\n"
            f"h = subprocess.Popen([sys.executable, '-c', {ignore + 'import time; time.sleep(60)'!r}])\n"
            f"time.sleep(1.5)\n"  # its handler in place, and the watchdog has noted it
            f"open({str(helper)!r}, 'w').write(f'{{h.pid}} {{w.pid}}')\n"
            "if sys.argv[1] == 'let go':\n    close_watchdog(w)\n")
    for how in ("killed", "let go"):
        parent = subprocess.Popen([sys.executable, "-c", "import time\n" + code + "print('up', flush=True)\ntime.sleep(60)",
                                   how], stdout=subprocess.PIPE, text=True)
        assert parent.stdout.readline().strip() == "up"
        child, watchdog = map(int, helper.read_text().split())
        try:
            if how == "killed":
                parent.kill()
                parent.wait()
                assert gone(child, within=15.0), "the child outlived its killed parent"
                assert gone(watchdog)
            else:
                assert gone(watchdog) and not gone(child, within=0.5), "a watchdog let go stopped the child"
        finally:
            for pid in (child, parent.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            parent.wait()
