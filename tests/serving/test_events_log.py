"""The event log's delivery logic with a fake Kafka producer: never blocks the caller, spools while the
broker is away, resends the spool in order when it is back, and loses nothing on close.

(The real broker, and a real outage, are in test_server.py.)
"""

import json
import threading
import time

import pytest

from ingest.events import FeedbackEvent, InteractionEvent
from serving.events_log import EventLog
from serving.metrics import ServingMetrics

pytestmark = pytest.mark.unit


class FakeFuture:
    def __init__(self, ok):
        self.is_done = True
        self._ok = ok

    def succeeded(self):
        return self._ok


class FakeBroker:
    """Stands in for Kafka: records what was acknowledged; `up` decides whether connecting/sending works."""

    def __init__(self):
        self.up = True
        self.received = []
        self.lock = threading.Lock()

    def producer(self, bootstrap):
        if not self.up:
            raise ConnectionError(f"no broker at {bootstrap}")
        return FakeProducer(self)


class FakeProducer:
    def __init__(self, broker):
        self.broker = broker

    def send(self, topic, key, value):
        ok = self.broker.up
        if ok:
            with self.broker.lock:
                self.broker.received.append((topic, key.decode(), json.loads(value)["id"]))
        return FakeFuture(ok)

    def flush(self, timeout=None):
        pass

    def close(self, timeout=None):
        pass


def interaction(i, tenant="acme"):
    return InteractionEvent(id=f"i{i}", tenant=tenant, completion="c", prompt="p")


def make_log(tmp_path, broker):
    return EventLog(
        bootstrap="fake:9092", interactions_topic="t.interactions", feedback_topic="t.feedback",
        spool_dir=tmp_path / "spool", metrics=ServingMetrics(), producer_factory=broker.producer,
        retry_seconds=0.05,
    ).start()


def wait_for(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_events_reach_their_topics_keyed_by_tenant(tmp_path):
    broker = FakeBroker()
    log = make_log(tmp_path, broker)
    log.log(interaction(1))
    log.log(FeedbackEvent(id="i1", tenant="acme", score=0.5))
    wait_for(lambda: len(broker.received) == 2)
    log.close()
    assert broker.received == [("t.interactions", "acme", "i1"), ("t.feedback", "acme", "i1")]


def test_outage_spools_then_resends_everything_in_order(tmp_path):
    broker = FakeBroker()
    broker.up = False
    log = make_log(tmp_path, broker)
    started = time.monotonic()
    for i in range(50):
        log.log(interaction(i))
    assert time.monotonic() - started < 0.5  # logging never waits for the broker
    wait_for(lambda: log.spooled == 50)
    assert broker.received == []
    broker.up = True
    wait_for(lambda: len(broker.received) == 50 and log.spooled == 0)
    for i in range(50, 60):  # after the backlog, straight through again
        log.log(interaction(i))
    wait_for(lambda: len(broker.received) == 60)
    log.close()
    assert [r[2] for r in broker.received] == [f"i{i}" for i in range(60)]
    assert not list((tmp_path / "spool").iterdir())
    events = log.metrics.events
    assert events.labels("interaction", "spooled")._value.get() == 50
    assert events.labels("interaction", "resent")._value.get() == 50


def test_close_with_the_broker_away_keeps_everything_on_disk(tmp_path):
    broker = FakeBroker()
    broker.up = False
    log = make_log(tmp_path, broker)
    for i in range(5):
        log.log(interaction(i))
    log.close()
    broker.up = True
    again = make_log(tmp_path, broker)  # the next process sends what the last one spooled
    wait_for(lambda: len(broker.received) == 5)
    again.close()
    assert sorted(r[2] for r in broker.received) == [f"i{i}" for i in range(5)]


class HangingProducer(FakeProducer):
    """A broker that takes messages but never acknowledges them: flush waits out its whole timeout."""

    def send(self, topic, key, value):
        future = FakeFuture(False)
        future.is_done = False
        return future

    def flush(self, timeout=None):
        time.sleep(timeout)
        raise TimeoutError(f"no acknowledgement within {timeout}s")


def test_a_stop_with_a_hanging_broker_spools_the_queue_within_its_timeout(tmp_path):
    broker = FakeBroker()
    log = EventLog(
        bootstrap="fake:9092", interactions_topic="t.interactions", feedback_topic="t.feedback",
        spool_dir=tmp_path / "spool", metrics=ServingMetrics(), producer_factory=lambda b: HangingProducer(broker),
        retry_seconds=0.05, ack_timeout=30.0,
    ).start()
    log.log(interaction(0))
    time.sleep(0.3)  # the first batch is being sent: its flush would wait 30 s
    for i in range(1, 1200):  # more than one batch behind it
        log.log(interaction(i))
    started = time.monotonic()
    log.close(timeout=3.0)
    assert time.monotonic() - started < 3.5 and not log._thread.is_alive()
    broker.up = True
    again = make_log(tmp_path, broker)  # everything logged is in the spool: the next start sends it
    wait_for(lambda: len(broker.received) == 1200)
    again.close()
    assert sorted(int(r[2][1:]) for r in broker.received) == list(range(1200))
