"""`Ingest.run` with `max_seconds` (`clora ingest --max-seconds N`): it consumes, stores and commits until N
seconds have passed, then returns on its own, with nothing set to stop it.

Kafka's clients are fakes (what run() and its loop ask of them: a partition assigned on the first poll, one
batch of records, then nothing); the processing, the Parquet writes and the commits' offsets are the real
ones. The real process against the real broker is in test_ingest_process.py.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
from kafka import TopicPartition
from kafka_fakes import FakeConsumer, FakeConsumerRecord

import ingest.consumer as consumer_module
from ingest.batch import Processor
from ingest.consumer import Ingest
from ingest.events import InteractionEvent, encode
from ingest.metrics import IngestMetrics
from storage.parquet import read_dataset

pytestmark = pytest.mark.unit

PARTITION = TopicPartition("t.i", 0)
SAFETY_POLLS = 2000  # a loop that ignores its deadline is stopped after this many polls (about 20 s)


class FakeProducer:
    def __init__(self, **_settings):
        self.sent = []

    def send(self, topic, **kw):
        self.sent.append((topic, kw))
        raise AssertionError("no dead letter expected")

    def flush(self, timeout=None):
        pass

    def close(self, timeout=None):
        pass


class FakeGroupConsumer(FakeConsumer):
    """Made by `Ingest.run` in place of KafkaConsumer. The group assigns PARTITION on the first poll; the next
    poll hands out `batch`; every later one comes back empty after 10 ms. Past SAFETY_POLLS polls it sets
    `stop`, so a loop that never ends on its own fails the test instead of hanging it."""

    stop: threading.Event
    batch: list[FakeConsumerRecord]
    made: list[FakeGroupConsumer] = []

    def __init__(self, **settings):
        super().__init__()
        self.settings = settings
        self.listener = None
        self.polls = 0
        FakeGroupConsumer.made.append(self)

    def subscribe(self, topics, listener):
        self.topics, self.listener = topics, listener

    def poll(self, timeout_ms, max_records):
        self.polls += 1
        if self.polls >= SAFETY_POLLS:
            self.stop.set()
        if self.polls == 1:
            self.assigned = {PARTITION}
            self.listener.on_partitions_assigned([PARTITION])
            return {}
        if records := self.records(self.polls - 2):
            return {PARTITION: records}
        time.sleep(0.01)
        return {}

    def records(self, k: int) -> list[FakeConsumerRecord]:
        """What the k-th poll after the assignment hands out: the whole batch, then nothing."""
        return list(self.batch) if k == 0 else []


def fake_clients_ingest(data_dir, monkeypatch, consumer: type, *, flush_rows: int, flush_seconds: float) -> Ingest:
    """An Ingest of tenant "acme" (inline rewards) whose Kafka clients are `consumer` and FakeProducer."""
    monkeypatch.setattr(consumer_module, "KafkaConsumer", consumer)
    monkeypatch.setattr(consumer_module, "KafkaProducer", FakeProducer)
    return Ingest(root=str(data_dir), bootstrap="fake:9092", interactions_topic="t.i", feedback_topic="t.f",
                  dead_letter_topic="t.d", group_id="g",
                  processor=Processor({"acme": "inline"}, unknown_tenant="reject", max_message_bytes=10_000),
                  flush_rows=flush_rows, flush_seconds=flush_seconds, expiry_ms=3_600_000, session_timeout_ms=10_000,
                  heartbeat_interval_ms=3_000, metrics=IngestMetrics())


def test_max_seconds_ends_the_run_once_that_long_has_passed(data_dir, monkeypatch, caplog):
    stop = threading.Event()
    FakeGroupConsumer.stop, FakeGroupConsumer.made = stop, []
    FakeGroupConsumer.batch = [
        FakeConsumerRecord("t.i", 0, k, encode(InteractionEvent(id=f"r{k}", tenant="acme", prompt="p", completion="c")),
                           b"acme")
        for k in range(3)
    ]
    ingest = fake_clients_ingest(data_dir, monkeypatch, FakeGroupConsumer, flush_rows=100, flush_seconds=0.2)
    max_seconds = 1.5
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="ingest.consumer"):
        ingest.run(stop, max_seconds=max_seconds)
    ended = time.monotonic()
    (consumer,) = FakeGroupConsumer.made
    assert not stop.is_set(), f"the run did not end on its own: stopped after {consumer.polls} polls"
    assert "--max-seconds reached" in caplog.text
    assert ended - started >= max_seconds, "it ended before its N seconds were up"
    assert consumer.polls > 3  # it kept consuming (empty polls) until then
    # what it read meanwhile is stored and committed, and the clients are closed
    assert sorted(read_dataset(str(data_dir), "interactions").column("id").to_pylist()) == ["r0", "r1", "r2"]
    assert consumer.commits == [{PARTITION: 3}] and consumer.closed


class TrickleConsumer(FakeGroupConsumer):
    """A partition that never runs dry while `batch` lasts: one record per poll, so only a batch's size (rows
    or bytes) or age flushes it."""

    def records(self, k: int) -> list[FakeConsumerRecord]:
        return [self.batch[k]] if k < len(self.batch) else []


def test_a_batch_is_flushed_at_its_bytes_too_not_only_at_its_rows(data_dir, monkeypatch):
    """flush_rows alone let 5,000 messages of up to 1 MB each (5 GB) wait in memory for their batch."""
    stop = threading.Event()
    TrickleConsumer.stop, FakeGroupConsumer.made = stop, []
    TrickleConsumer.batch = [
        FakeConsumerRecord("t.i", 0, k, encode(InteractionEvent(id=f"r{k}", tenant="acme", prompt="p",
                                                                completion="c" * 400)), b"acme")
        for k in range(6)
    ]
    size = len(TrickleConsumer.batch[0].value)
    monkeypatch.setattr(consumer_module, "FLUSH_BYTES", 2 * size)  # two messages' worth
    ingest = fake_clients_ingest(data_dir, monkeypatch, TrickleConsumer, flush_rows=1000, flush_seconds=3600)
    ingest.run(stop, max_seconds=1.0)
    (consumer,) = FakeGroupConsumer.made
    assert [c[PARTITION] for c in consumer.commits] == [2, 4, 6], "a batch every two messages' bytes"
    assert sorted(read_dataset(str(data_dir), "interactions").column("id").to_pylist()) == [f"r{k}" for k in range(6)]
