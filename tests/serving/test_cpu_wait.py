"""serving/cpu_wait.py: on CPU, vLLM's message-queue readers pause between polls instead of spinning."""

from __future__ import annotations

import importlib.metadata
import time

import pytest

from serving import cpu_wait

pytestmark = pytest.mark.unit


def test_the_plugin_is_declared_and_replaces_the_spin(monkeypatch):
    plugins = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert plugins.get("clora_cpu_wait") == "serving.cpu_wait:register"
    from vllm.distributed import utils
    from vllm.distributed.device_communicators import shm_broadcast

    monkeypatch.setattr(shm_broadcast, "sched_yield", utils.sched_yield)
    monkeypatch.setenv(cpu_wait.ENV, "spin")
    cpu_wait.register()
    assert shm_broadcast.sched_yield is utils.sched_yield  # vLLM's own
    monkeypatch.setenv(cpu_wait.ENV, "sleep")
    cpu_wait.register()
    assert shm_broadcast.sched_yield is cpu_wait.pause
    monkeypatch.setenv(cpu_wait.ENV, "nap")
    with pytest.raises(ValueError, match=cpu_wait.ENV):
        cpu_wait.register()


def test_a_pause_gives_the_core_away_for_about_the_poll_interval():
    import resource

    started, cpu = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF).ru_utime
    for _ in range(200):
        cpu_wait.pause()
    elapsed = time.monotonic() - started
    used = resource.getrusage(resource.RUSAGE_SELF).ru_utime - cpu
    assert elapsed >= 200 * cpu_wait.POLL_SLEEP_S
    assert used < elapsed / 2  # sleeping, not spinning
