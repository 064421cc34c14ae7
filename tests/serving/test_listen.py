"""The serving process binds its port before the engine's long start: a taken port fails at once, clearly."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from serving_process import REPO, write_config

pytestmark = pytest.mark.unit


def test_a_taken_port_fails_the_start_at_once_with_a_clear_message(tmp_path, tiny_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        config = write_config(tmp_path, bootstrap="127.0.0.1:9", model_path=tiny_model, port=port)
        result = subprocess.run([sys.executable, "-m", "serving", "--config", str(config)], cwd=REPO,
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "starting the engine" not in result.stderr + result.stdout  # it never got that far


def test_listen_binds_without_accepting_yet():
    from serving.__main__ import listen

    sock = listen("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        with pytest.raises(ConnectionRefusedError):  # bound, not listening: clients are refused, not queued
            socket.create_connection(("127.0.0.1", port), timeout=2)
    finally:
        sock.close()


def test_a_helper_task_that_failed_does_not_stop_the_shutdown(caplog):
    """The stop awaits the adapter watcher and the engine monitor before the event log drains: one that
    raised is logged and stands for `failed`, so what follows it still runs."""
    import asyncio

    from serving.__main__ import ended

    async def broken():
        raise RuntimeError("monitor broke")

    async def fine():
        return False

    async def both():
        return (await ended(asyncio.create_task(broken()), "the engine monitor", failed=True),
                await ended(asyncio.create_task(fine()), "the adapter watcher", failed=True))

    assert asyncio.run(both()) == (True, False)
    assert "the engine monitor failed; stopping anyway" in caplog.text and "monitor broke" in caplog.text
