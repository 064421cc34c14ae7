"""A serving process stopped while its engine starts (a model loaded, kernels warmed: up to a minute): the
engine's start hears no signal, so a first Ctrl-C is answered at once, and a SIGKILL then leaves none of
the engine's processes behind."""

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


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_serving_interrupted_while_its_engine_starts_says_so_and_a_kill_then_leaves_no_engine(tmp_path, tiny_model):
    from ingest.broker import free_port

    config = write_config(tmp_path, bootstrap="127.0.0.1:9", model_path=tiny_model, port=free_port())
    log = tmp_path / "serving.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "serving", "--config", str(config)], cwd=REPO, env=env,
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    noted: set[int] = set()
    try:
        deadline = time.monotonic() + 180
        engine = []
        while not engine:  # the engine's own processes (not the watchdog): its start is under way
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"no engine process within 180 s:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
            kids = descendants(proc.pid)
            noted |= set(kids)
            engine = [pid for pid in kids if "_watch_over" not in _cmdline(pid)]
        proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 5
        while "stopping once the engine has started" not in log.read_text():
            assert time.monotonic() < deadline, f"a Ctrl-C during the engine's start went unanswered:\n{log.read_text()[-3000:]}"
            time.sleep(0.1)
        time.sleep(1.0)  # the engine's workers, if any, have started: noted too
        noted |= set(descendants(proc.pid))
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 30
        while [pid for pid in noted if _alive(pid)] and time.monotonic() < deadline:
            time.sleep(0.2)
        left = {pid: _cmdline(pid) for pid in noted if _alive(pid)}
        assert not left, f"left running after serving was killed during its engine's start: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in noted:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
