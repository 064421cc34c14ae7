"""Kafka goes away and comes back: requests keep succeeding, their events wait in the spool on disk,
and reach Kafka once it is back.

This test owns its broker (a private embedded broker on its own port, so the session broker stays up
for everyone else) and therefore its own serving process.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import openai
import pytest

from serving_process import read_events, start_server, stop_server

pytestmark = pytest.mark.integration

TOPICS = ["clora.interactions", "clora.feedback", "clora.dead-letter"]
MESSAGES = [{"role": "user", "content": "Give me 5 digits."}]


def wait(condition, what, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_requests_succeed_while_kafka_is_down_and_events_arrive_after(tmp_path, tiny_model):
    from ingest.broker import EmbeddedBroker, free_port

    port = free_port()
    broker = EmbeddedBroker("127.0.0.1", port).start(TOPICS, partitions=2)
    server = None
    try:
        server = start_server(tmp_path / "srv", bootstrap=broker.bootstrap, model_path=tiny_model)
        c = openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.keys["acme"], max_retries=0, timeout=60)

        before = c.chat.completions.create(model="acme", messages=MESSAGES, max_tokens=4)
        assert set(read_events(broker.bootstrap, "clora.interactions", {before.id})) == {before.id}

        broker.stop()
        during = [c.chat.completions.create(model="acme", messages=MESSAGES, max_tokens=4) for _ in range(5)]
        assert all(r.choices[0].finish_reason in ("stop", "length") for r in during)
        ids = {r.id for r in during}
        wait(lambda: server.health()["events"]["spooled"] >= len(ids), "the events to be spooled")
        assert not server.health()["events"]["kafka_connected"]

        broker = EmbeddedBroker("127.0.0.1", port).start(TOPICS, partitions=2)  # back, empty (memory storage)
        wait(lambda: server.health()["events"]["spooled"] == 0, "the spool to drain")
        events = read_events(broker.bootstrap, "clora.interactions", ids)
        assert set(events) == ids
        assert all(e["tenant"] == "acme" and e["completion"] == r.choices[0].message.content
                   for r in during for e in [events[r.id]])
        assert list((server.data_dir / "state" / "serving-spool").glob("*.jsonl")) == []

        # vLLM's IPC sockets are in the process's own directory (vLLM left them in /tmp for good), removed at stop.
        (ipc,) = Path(tempfile.gettempdir()).glob(f"clora-vllm-ipc-*-{server.process.pid}-*")
        assert any(p.is_socket() for p in ipc.iterdir())
        stop_server(server)
        assert server.process.returncode == 0 and not ipc.exists()
        server = None
    finally:
        if server is not None:
            stop_server(server)
        broker.stop()
