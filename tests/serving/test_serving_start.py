"""A serving process stopped while its engine starts (a model loaded, kernels warmed: up to a minute): the
engine's start heard no signal (a Ctrl-C was answered once it ended), and a SIGKILL then left the engine's
processes running on their own. Now a signal cuts the start short, and a SIGKILL leaves nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from serving_process import REPO, write_config

from clora.processes import descendants

pytestmark = pytest.mark.integration


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _marked(mark: str) -> set[int]:
    """Processes whose environment holds CLORA_TEST_MARK=`mark`: a serving process started with it and every
    process it started, also those a SIGKILL left with no parent (no longer its descendants)."""
    found, needle = set(), f"CLORA_TEST_MARK={mark}".encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        found.add(int(entry))
            except OSError:
                pass
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _start_and_wait_for_the_engine(tmp_path, tiny_model):
    """A serving process, once its engine's own processes (not the watchdog) run; with the pids noted."""
    from ingest.broker import free_port

    tmp_path.mkdir(parents=True, exist_ok=True)
    config = write_config(tmp_path, bootstrap="127.0.0.1:9", model_path=tiny_model, port=free_port())
    log = tmp_path / "serving.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "CLORA_TEST_MARK": str(tmp_path)}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "serving", "--config", str(config)], cwd=REPO, env=env,
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    noted: set[int] = set()
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no engine process within 180 s:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)
        kids = descendants(proc.pid)
        noted |= set(kids)
        if [pid for pid in kids if "_watch_over" not in _cmdline(pid)]:
            return proc, log, noted


def _assert_all_gone(noted: set[int], what: str) -> None:
    deadline = time.monotonic() + 30
    while [pid for pid in noted if _alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {pid: _cmdline(pid) for pid in noted if _alive(pid)}
    assert not left, f"left running after {what}: {left}"


@pytest.mark.parametrize("how", ["SIGINT", "SIGKILL"])
def test_a_serving_stopped_while_its_engine_starts_stops_at_once_and_leaves_no_engine(tmp_path, tiny_model, how):
    proc, log, noted = _start_and_wait_for_the_engine(tmp_path / how, tiny_model)
    try:
        time.sleep(1.0)  # into the engine's start
        proc.send_signal(getattr(signal, how))
        try:
            code = proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{how} during the engine's start: still running 15 s later:\n"
                                 f"{log.read_text()[-3000:]}") from None
        if how == "SIGINT":
            assert code == 0, log.read_text()[-3000:]
            assert "serving stopped during the engine's start" in log.read_text()
        # Also what no longer descends from serving: the engine's processes a SIGKILL left behind are orphans.
        noted |= _marked(str(tmp_path / how))
        _assert_all_gone(noted, f"a {how} during the engine's start")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in noted:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
