"""The event log against the real embedded broker: an event Kafka refuses for good (larger than the
producer's max_request_size) is dead-lettered under the spool directory with its reason, and the events
around it, spooled or sent straight, still reach Kafka.

(The fake-producer tests of the same logic are in test_events_log.py; no vLLM engine here.)
"""

from __future__ import annotations

import json
import time
import uuid

import pytest

from ingest.events import InteractionEvent
from serving.events_log import EventLog, kafka_producer
from serving.metrics import ServingMetrics
from serving_process import read_events

pytestmark = pytest.mark.integration

BIG = 1_500_000  # characters of completion: over kafka-python's default max_request_size of 1 MiB


def wait_for(condition, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_an_oversized_event_is_dead_lettered_and_the_events_after_it_reach_kafka(tmp_path, broker):
    from clora.config import KafkaConfig

    topics = KafkaConfig()
    run = uuid.uuid4().hex[:8]
    up = False

    def producer(bootstrap):
        if not up:
            raise ConnectionError(f"no broker at {bootstrap} (the test keeps it away)")
        return kafka_producer(bootstrap)

    def event(name, size=1):
        return InteractionEvent(id=f"{run}-{name}", tenant="acme", prompt="p", completion="c" * size)

    log = EventLog(
        bootstrap=broker.bootstrap, interactions_topic=topics.interactions_topic,
        feedback_topic=topics.feedback_topic, spool_dir=tmp_path / "spool", metrics=ServingMetrics(),
        producer_factory=producer, retry_seconds=0.1,
    ).start()
    try:
        # Kafka away: the oversized event is spooled between normal ones, then resent with them.
        for name, size in [("a", 1), ("big1", BIG), ("b", 1)]:
            log.log(event(name, size))
        wait_for(lambda: log.spooled == 3, "the spool")
        up = True
        wait_for(lambda: log.spooled == 0, "the spool to empty")
        # Kafka there: sent straight, no spool.
        for name, size in [("c", 1), ("big2", BIG), ("d", 1)]:
            log.log(event(name, size))
        normal = {f"{run}-{n}" for n in "abcd"}
        found = read_events(broker.bootstrap, topics.interactions_topic, normal)
        assert set(found) == normal
        wait_for(lambda: log.metrics.events.labels("interaction", "dead")._value.get() == 2, "two dead letters")
    finally:
        log.close()

    dead = [json.loads(line) for f in sorted((tmp_path / "spool" / "dead").iterdir()) for line in f.open()]
    assert [(json.loads(d["value"])["id"], d["reason"], d["key"], d["topic"]) for d in dead] == [
        (f"{run}-big1", "too_large", "acme", topics.interactions_topic),
        (f"{run}-big2", "too_large", "acme", topics.interactions_topic),
    ]
    assert all("MessageSizeTooLargeError" in d["detail"] and d["version"] == 1 for d in dead)
    assert len(json.loads(dead[0]["value"])["completion"]) == BIG  # the whole event is kept
    assert not [p for p in (tmp_path / "spool").iterdir() if p.name != "dead"]  # nothing else left


def test_closing_a_producer_whose_broker_hangs_stops_its_io_thread():
    """kafka-python's close() flushes first and, with a message unacknowledged at its timeout, raises before
    it stops its I/O thread, which then resends for ever with its sockets: one more thread per such close
    (the event log closes its producer after every failed send). close_producer stops it."""
    import os
    import signal

    from kafka.errors import KafkaTimeoutError

    from ingest.broker import EmbeddedBroker, free_port
    from serving.events_log import close_producer

    hung = EmbeddedBroker("127.0.0.1", free_port()).start(["t.hang"])  # its own: this test freezes it
    producers = []
    try:
        for _ in range(2):
            producers.append(kafka_producer(hung.bootstrap))
            producers[-1].send("t.hang", b"x").get(timeout=30)  # connected, the topic's metadata known
        os.kill(hung.process.pid, signal.SIGSTOP)
        try:
            plain, ours = producers
            for producer in producers:
                producer.send("t.hang", b"never acknowledged")
            with pytest.raises(KafkaTimeoutError):
                plain.close(timeout=0)
            assert plain._sender.is_alive(), "kafka-python's own close() left its I/O thread running"
            close_producer(ours, 0)
            assert not ours._sender.is_alive()
        finally:
            os.kill(hung.process.pid, signal.SIGCONT)
    finally:
        for producer in producers:
            close_producer(producer, 0)
        hung.stop()
