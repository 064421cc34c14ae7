"""The embedded broker: start-up, a producer/consumer round trip over TCP, clean stop, clear errors."""

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from kafka import KafkaConsumer, KafkaProducer

from ingest.broker import BrokerError, EmbeddedBroker, ensure_topics, free_port, not_kafka

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


class Output:
    """A child's output, read line by line in a thread (a child that never says it is ready must fail the test,
    not hang it on a readline)."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        self.reader = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.reader.start()

    def _read(self, proc):
        for line in proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def until(self, start: str, timeout: float) -> str:
        """The first line that starts with `start` ("" when the output ended, or none came within `timeout`)."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            self.seen.append(line)
            if line.startswith(start):
                return line
        return ""

    def rest(self) -> str:
        """Everything after what was read so far (call once the child has exited)."""
        self.reader.join(30)
        while (line := self.lines.get_nowait()) is not None:
            self.seen.append(line)
        return "".join(self.seen)


def start_clora_broker(cwd, port: int) -> tuple[subprocess.Popen, str, Output]:
    """`clora broker --port PORT` as a child; returns it, the "broker ready at ..." line it prints ("" when it
    exited or printed none within 60 s; its log has a line like it, which does not count) and its output."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "clora", "broker", "--port", str(port)],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    output = Output(proc)
    return proc, output.until("broker ready at ", 60), output


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


def test_the_broker_answers_as_kafka_and_another_service_on_a_port_does_not(broker):
    """`clora config check` asks the bootstrap server a Kafka question; an open port alone passed as "Kafka
    answers", and ingest then retried that port for a minute."""
    assert not_kafka(broker.bootstrap) is None
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()

        def answer_as_http():
            conn, _ = listener.accept()
            with conn:
                conn.recv(64)
                conn.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n")

        threading.Thread(target=answer_as_http, daemon=True).start()
        why = not_kafka(f"127.0.0.1:{listener.getsockname()[1]}")
    assert why is not None and "not as a Kafka broker does" in why and "HTTP" in why


def test_config_check_finds_the_embedded_brokers_port_held_by_a_running_kafka(broker, tmp_path, capsys):
    """`clora up` refuses to start the embedded broker on a port another process holds; with a Kafka there, the
    check says to use it (broker.embedded = false), which then passes."""
    from clora.cli import main

    host, port = broker.bootstrap.rsplit(":", 1)
    config = tmp_path / "clora.toml"
    config.write_text(f'data_dir = "{tmp_path / "data"}"\n[broker]\nport = {port}\n'
                      f'[kafka]\nbootstrap = "{broker.bootstrap}"\n')
    assert main(["config", "check", "--config", str(config)]) == 1
    problems = [line.split("PROBLEM", 1)[1].strip() for line in capsys.readouterr().out.splitlines() if "PROBLEM" in line]
    assert len(problems) == 1 and problems[0].startswith(f"Kafka already answers at {broker.bootstrap}, where `clora up`")
    config.write_text(config.read_text().replace("[broker]\n", "[broker]\nembedded = false\n"))
    assert main(["config", "check", "--config", str(config)]) == 0
    assert f"  ok       Kafka answers at {broker.bootstrap}" in capsys.readouterr().out


def test_port_taken_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(BrokerError, match=f"port {port} .* already in use"):
            EmbeddedBroker("127.0.0.1", port).start()


def test_an_address_it_cannot_listen_on_is_a_clear_error():
    """The broker exited at once, and `clora broker` said only "exited with code 0 at start"."""
    with pytest.raises(BrokerError, match=r"^cannot listen on 192\.0\.2\.1:\d+: Cannot assign requested address$"):
        EmbeddedBroker("192.0.2.1", free_port()).start()  # an address of no machine (TEST-NET-1)


def test_clora_broker_command_says_it_is_ready_and_stops_on_sigterm(tmp_path):
    port = free_port()
    proc, line, output = start_clora_broker(tmp_path, port)
    try:
        # (how long it takes is for the benchmarks)
        ready = f"broker ready at 127.0.0.1:{port} (topics: clora.interactions, clora.feedback, clora.dead-letter)"
        assert line.startswith(ready), "".join(output.seen)
        # the topics exist and a client can use them
        assert ensure_topics(f"127.0.0.1:{port}", ["clora.interactions", "clora.feedback"], 4) == []
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        rest = output.rest()
        assert "broker stopped" in rest and "keeps every event in memory until it stops" in rest
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
    proc, line, output = start_clora_broker(tmp_path, port)
    try:
        assert "broker ready" in line, "".join(output.seen)
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
