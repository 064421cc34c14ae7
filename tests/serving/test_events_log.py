"""The event log's delivery logic with a fake Kafka producer: never blocks the caller, spools while the
broker is away, resends the spool in order when it is back, and loses nothing on close; dead-letters what
Kafka refuses for good and goes on; keeps at most `queue_bytes` in memory.

(The real broker is in test_events_log_broker.py; a real outage of a serving process in
test_server_outage.py.)
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
    def __init__(self, ok, exception=None):
        self.is_done = True
        self._ok = ok
        self.exception = exception

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


# --- messages Kafka refuses for good ------------------------------------------------------------------------


class RefusingProducer(FakeProducer):
    """The broker refuses events whose completion is "BIG" (too large for its limit) in the send's answer,
    and with `error` set, answers every other send with that error."""

    error = None

    def send(self, topic, key, value):
        from kafka.errors import MessageSizeTooLargeError

        if json.loads(value).get("completion") == "BIG":
            return FakeFuture(False, MessageSizeTooLargeError("the broker's limit is 1048588 bytes"))
        if self.error is not None:
            return FakeFuture(False, self.error)
        return super().send(topic, key, value)


def dead_letters(tmp_path):
    return [json.loads(line) for f in sorted((tmp_path / "spool" / "dead").glob("*.jsonl")) for line in f.open()]


def test_an_event_the_broker_refuses_for_good_is_dead_lettered_and_the_spool_moves_past_it(tmp_path):
    broker = FakeBroker()
    broker.up = False
    log = EventLog(
        bootstrap="fake:9092", interactions_topic="t.interactions", feedback_topic="t.feedback",
        spool_dir=tmp_path / "spool", metrics=ServingMetrics(),
        producer_factory=lambda b: broker.producer(b) and RefusingProducer(broker), retry_seconds=0.05,
    ).start()
    big = InteractionEvent(id="big", tenant="acme", completion="BIG", prompt="p")
    for e in [interaction(0), big, interaction(1)]:  # spooled while the broker is away
        log.log(e)
    wait_for(lambda: log.spooled == 3)
    broker.up = True
    wait_for(lambda: len(broker.received) == 2 and log.spooled == 0)
    for e in [interaction(2), big, interaction(3)]:  # sent straight
        log.log(e)
    wait_for(lambda: len(broker.received) == 4)
    log.close()
    assert [r[2] for r in broker.received] == ["i0", "i1", "i2", "i3"]
    dead = dead_letters(tmp_path)
    assert [(json.loads(d["value"])["id"], d["reason"], d["key"]) for d in dead] == [("big", "too_large", "acme")] * 2
    assert "1048588" in dead[0]["detail"]
    assert log.metrics.events.labels("interaction", "dead")._value.get() == 2
    assert [p.name for p in (tmp_path / "spool").iterdir()] == ["dead"]


def test_errors_that_hold_for_every_message_keep_the_events_in_the_spool(tmp_path):
    from kafka.errors import TopicAuthorizationFailedError  # not retriable, yet fixed by fixing the cluster

    broker = FakeBroker()
    RefusingProducer.error = TopicAuthorizationFailedError("not allowed to write t.interactions")
    try:
        log = EventLog(
            bootstrap="fake:9092", interactions_topic="t.interactions", feedback_topic="t.feedback",
            spool_dir=tmp_path / "spool", metrics=ServingMetrics(),
            producer_factory=lambda b: RefusingProducer(broker), retry_seconds=0.05,
        ).start()
        for i in range(3):
            log.log(interaction(i))
        wait_for(lambda: log.spooled == 3)
        time.sleep(0.2)  # several resends, all refused
        assert log.spooled == 3 and not (tmp_path / "spool" / "dead").exists()
        RefusingProducer.error = None  # the ACL is fixed
        wait_for(lambda: len(broker.received) == 3 and log.spooled == 0)
        log.close()
    finally:
        RefusingProducer.error = None
    assert [r[2] for r in broker.received] == ["i0", "i1", "i2"]


# --- the bound on memory ------------------------------------------------------------------------------------


class GatedProducer(FakeProducer):
    """A broker that holds every acknowledgement until `gate` is set (flush waits for it, then gives up)."""

    gate = threading.Event()

    def __init__(self, broker):
        super().__init__(broker)
        self.pending = []

    def send(self, topic, key, value):
        future = FakeFuture(False)
        future.is_done = False
        self.pending.append((future, (topic, key.decode(), json.loads(value)["id"])))
        return future

    def flush(self, timeout=None):
        if not self.gate.wait(timeout):
            raise TimeoutError(f"no acknowledgement within {timeout}s")
        for future, record in self.pending:
            with self.broker.lock:
                self.broker.received.append(record)
            future.is_done, future._ok = True, True
        self.pending = []


def test_past_its_bound_the_queue_goes_to_the_spool_in_order_and_nothing_is_lost(tmp_path):
    broker = FakeBroker()
    GatedProducer.gate = threading.Event()
    bound = 2000  # bytes of event JSON: about a dozen events
    log = EventLog(
        bootstrap="fake:9092", interactions_topic="t.interactions", feedback_topic="t.feedback",
        spool_dir=tmp_path / "spool", metrics=ServingMetrics(), producer_factory=lambda b: GatedProducer(broker),
        retry_seconds=0.05, ack_timeout=30.0, queue_bytes=bound,
    ).start()
    log.log(interaction(0))
    wait_for(lambda: log._in_flight)  # its send now waits for the gate
    started = time.monotonic()
    for i in range(1, 300):
        log.log(interaction(i))
        assert log._queued_bytes <= bound
    assert time.monotonic() - started < 2.0  # a spill is a local append, not a wait for Kafka
    assert log.spool.pending() > 250  # spilled to disk, the batch in flight with them
    GatedProducer.gate.set()
    wait_for(lambda: {r[2] for r in broker.received} == {f"i{i}" for i in range(300)} and log.spooled == 0)
    log.close()
    ids = [r[2] for r in broker.received]
    first = sorted(set(ids), key=ids.index)  # the batch in flight arrives twice: sent, and spilled
    assert first == [f"i{i}" for i in range(300)]
    assert len(ids) - 300 <= 1
