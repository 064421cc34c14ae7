"""The embedded broker: start-up, a producer/consumer round trip over TCP, clean stop, clear errors."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from kafka import KafkaConsumer, KafkaProducer

from ingest.broker import BrokerError, EmbeddedBroker, ensure_topics, free_port

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def start_clora_broker(cwd, port: int) -> tuple[subprocess.Popen, str]:
    """`clora broker --port PORT` as a child; returns it and the last line it printed (its "ready" line, unless
    it exited first)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "clora", "broker", "--port", str(port)],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    line = ""
    while proc.poll() is None and "broker ready" not in line:
        line = proc.stdout.readline()
    return proc, line


def test_round_trip_through_session_broker(broker):
    topic = "test.broker.roundtrip"
    assert ensure_topics(broker.bootstrap, [topic], partitions=2) == [topic]
    assert ensure_topics(broker.bootstrap, [topic], partitions=2) == []  # idempotent
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap)
    sent = {f"k{i}".encode(): f"value-{i}".encode() for i in range(50)}
    for k, v in sent.items():
        producer.send(topic, key=k, value=v)
    producer.flush()
    producer.close()
    consumer = KafkaConsumer(
        topic,
        bootstrap_servers=broker.bootstrap,
        group_id="test-roundtrip",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        session_timeout_ms=6000,
        heartbeat_interval_ms=2000,
    )
    got = {}
    deadline = time.monotonic() + 30
    while len(got) < len(sent) and time.monotonic() < deadline:
        for records in consumer.poll(500).values():
            got.update({r.key: r.value for r in records})
    consumer.close()
    assert got == sent


def test_port_taken_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(BrokerError, match=f"port {port} .* already in use"):
            EmbeddedBroker("127.0.0.1", port).start()


def test_clora_broker_command_starts_fast_and_stops_on_sigterm(tmp_path):
    port = free_port()
    t0 = time.monotonic()
    proc, line = start_clora_broker(tmp_path, port)
    try:
        ready_after = time.monotonic() - t0
        assert f"broker ready at 127.0.0.1:{port}" in line, line
        assert ready_after < 5.0, f"broker took {ready_after:.1f}s to come up"
        # the topics exist and a client can use them
        assert ensure_topics(f"127.0.0.1:{port}", ["clora.interactions", "clora.feedback"], 4) == []
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert "broker stopped" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with socket.socket() as s:  # the port is free again: the broker child is gone
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_a_sigkilled_owner_takes_its_broker_with_it(tmp_path):
    """`clora up` restarts a crashed `clora broker`; a Tansu orphan holding the port would make every
    restart fail with "port in use"."""
    port = free_port()
    proc, line = start_clora_broker(tmp_path, port)
    try:
        assert "broker ready" in line, line
        (tansu,) = psutil.Process(proc.pid).children()
        proc.kill()
        proc.wait()
        gone, alive = psutil.wait_procs([tansu], timeout=10)
        assert not alive, f"the broker outlived its SIGKILLed owner and still holds port {port}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for child in alive if "alive" in locals() else ():
            child.kill()
