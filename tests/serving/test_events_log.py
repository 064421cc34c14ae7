"""The event log's delivery logic with a fake Kafka producer: never blocks the caller, spools while the
broker is away, resends the spool in order when it is back, and loses nothing on close; dead-letters what
Kafka refuses for good and goes on; goes straight to Kafka again once a backlog is sent. Past `queue_bytes`
the thread spools the queue (the caller never touches the disk, and a spill makes segments of bounded
size), past twice that log() drops the newest, and a spool that fails costs the queue nothing. A broker
that is up but slow drains the spool a piece per try, each event sent once.

(The real broker is in test_events_log_broker.py; a real outage of a serving process in
test_server_outage.py.)
"""

import json
import os
import threading
import time

import pytest

from ingest.events import FeedbackEvent, InteractionEvent, encode
from serving import events_log
from serving.events_log import EventLog
from serving.metrics import ServingMetrics
from serving.spool import SpoolError

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


def make_log(tmp_path, broker, producer_factory=None, *, start=True, **settings):
    """An EventLog on `broker` (through `producer_factory` if given), spooling under tmp_path/spool."""
    log = EventLog(
        bootstrap="fake:9092", interactions_topic="t.interactions", feedback_topic="t.feedback",
        spool_dir=tmp_path / "spool", metrics=ServingMetrics(), producer_factory=producer_factory or broker.producer,
        retry_seconds=0.05, **settings,
    )
    return log.start() if start else log


def wait_for(condition, timeout=30.0):
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


def test_an_event_json_cannot_carry_is_dropped_counted_and_logged_not_raised(tmp_path, caplog):
    """A non-finite log-prob (a broken adapter's output) must not turn an answer already generated into an
    error: that one event is dropped, counted and logged; the next ones go on."""
    broker = FakeBroker()
    log = make_log(tmp_path, broker)
    bad = InteractionEvent(id="nan", tenant="acme", completion="c", prompt="p", completion_logprobs=[float("-inf")])
    with caplog.at_level("ERROR", logger="serving.events_log"):
        assert log.log(bad) is False
    assert log.log(interaction(2)) is True
    wait_for(lambda: len(broker.received) == 1)
    log.close()
    assert broker.received == [("t.interactions", "acme", "i2")]
    assert log.metrics.events.labels("interaction", "dropped")._value.get() == 1
    assert "dropped interaction event nan of tenant acme: it cannot be encoded as JSON" in caplog.text


def test_outage_spools_then_resends_everything_in_order(tmp_path):
    broker = FakeBroker()
    broker.up = False
    connecting, release, connected = threading.Event(), threading.Event(), threading.Event()

    def unanswered(bootstrap):
        """Connecting hangs (a broker that does not answer) until `release`; then it fails: the broker is down."""
        connecting.set()
        release.wait(30)
        connected.set()
        return broker.producer(bootstrap)

    log = make_log(tmp_path, broker, unanswered)
    log.log(interaction(0))
    assert connecting.wait(10), "the thread never tried to connect"
    for i in range(1, 50):  # logging never waits for the broker: all of these return while it connects
        log.log(interaction(i))
    assert not connected.is_set(), "log() waited for the connection attempt"
    release.set()
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


def test_an_event_logged_after_the_stop_is_spooled_for_the_next_start(tmp_path):
    """A request that ends during the stop (the server gave up waiting for it; its events logged on a thread)
    logs after the thread took its last batch: queued, nothing took it, and log() said it was kept."""
    broker = FakeBroker()
    log = make_log(tmp_path, broker)
    log.log(interaction(1))
    log.close(timeout=5)
    spooled = log.metrics.events.labels("interaction", "spooled")
    before = spooled._value.get()
    assert log.log(interaction(2)) is True
    assert spooled._value.get() == before + 1
    again = make_log(tmp_path, broker)  # the next start sends it
    wait_for(lambda: len(broker.received) == 2)
    again.close()
    assert [r[2] for r in broker.received] == ["i1", "i2"]


def test_with_kafka_away_events_reach_the_disk_between_connection_attempts_not_a_batch_per_attempt(tmp_path):
    """A connection attempt to a broker that is away takes about as long as retry_seconds (kafka-python's
    bootstrap timeout): the next was due as soon as one failed, so the thread connected back to back and
    spooled one batch per attempt; the rest of the queue waited in memory, lost to a kill. Now everything
    logged before an attempt failed is on disk before the next attempt starts, and a stop starts none."""
    logged, failed_with, found_spooled, stopping = [0], [], [], threading.Event()
    attempts_after_stop = []

    def slow_failure(bootstrap):
        if stopping.is_set():
            attempts_after_stop.append(bootstrap)
        found_spooled.append(log.spooled)  # what reached the disk before this attempt
        time.sleep(0.2)
        failed_with.append(logged[0])  # what had been logged when this attempt failed
        raise ConnectionError(f"no broker at {bootstrap}")

    log = make_log(tmp_path, FakeBroker(), slow_failure, start=False)
    log.retry_seconds = 0.2
    log.start()
    try:
        while len(failed_with) < 4:  # more than a batch per attempt, all the while
            for _ in range(100):
                log.log(interaction(logged[0]))
                logged[0] += 1
            time.sleep(0.01)
    finally:
        stopping.set()
        log.close(timeout=10.0)
    assert not attempts_after_stop, "a stop started a connection attempt with Kafka away"
    assert failed_with[0] > events_log.BATCH_MAX, "the test logged less than a batch per attempt"
    for k in range(1, len(failed_with)):
        assert found_spooled[k] >= failed_with[k - 1], (
            f"attempt {k + 1} began with {found_spooled[k]} events on disk of the {failed_with[k - 1]} logged "
            "before the previous attempt failed")
    assert events_log.Spool(tmp_path / "spool").pending() == logged[0]


def dead_pid() -> int:
    """The id of a process that has ended (and was reaped)."""
    import subprocess

    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def peer_segment(tmp_path, ids, *, alive, pid=None):
    """Another serving process's sealed spool segment holding interactions `ids`, and that process's Spool:
    `alive`, its writer file stays locked; else its writer is gone (its lock goes with a process however it
    ends, as at this close). `pid`: the process id its names carry (another container's may be any, ours too)."""
    peer = events_log.Spool(tmp_path / "spool")
    before = set((tmp_path / "spool").iterdir())
    peer.append([events_log.Message("t.interactions", "acme", encode(interaction(i)).decode()) for i in ids])
    peer.seal()
    if not alive:
        peer.close()
    (segment,) = [p for p in set((tmp_path / "spool").iterdir()) - before if p.suffix == ".jsonl"]
    if pid is not None:
        writer = tmp_path / "spool" / f"{os.getpid()}-{peer.id}.writer"
        writer.rename(writer.with_name(f"{pid}-{peer.id}.writer"))
        stamp, _, rest = segment.name.split("-", 2)
        segment = segment.rename(segment.with_name(f"{stamp}-{pid}-{rest}"))
    return segment, peer


@pytest.mark.parametrize("idle", [False, True], ids=["after traffic", "idle since its start"])
def test_segments_another_process_left_in_a_shared_spool_are_sent_by_a_live_one(tmp_path, idle):
    """A process whose own spool is empty never looked again: another's segments, left when it died (or
    stopped while Kafka was away), waited for some process to restart."""
    broker = FakeBroker()
    log = make_log(tmp_path, broker)
    if not idle:
        log.log(interaction(0))
        wait_for(lambda: len(broker.received) == 1)
    peer_segment(tmp_path, (1, 2, 3), alive=False)
    wait_for(lambda: len(broker.received) == (3 if idle else 4))
    log.close()
    assert sorted(r[2] for r in broker.received) == (["i1", "i2", "i3"] if idle else ["i0", "i1", "i2", "i3"])
    assert events_log.Spool(tmp_path / "spool").pending() == 0


def test_a_live_peers_segments_are_left_to_it_and_traffic_goes_straight_to_kafka(tmp_path):
    """The look for left segments took a live peer's too, even one it was draining (locked): the process then
    spooled all its own traffic for as long as the peer drained, and sent the peer's events out of its order."""
    import fcntl

    broker = FakeBroker()
    log = make_log(tmp_path, broker)
    waiting, writer = peer_segment(tmp_path, (1, 2), alive=True)  # a live writer's sealed segment
    draining, _ = peer_segment(tmp_path, (3, 4), alive=False)  # one a live peer claimed and is sending
    with draining.open("rb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        spool = events_log.Spool(tmp_path / "spool")
        assert spool.pending() == 2 and spool.left_behind() == 0
        for i in range(10, 20):
            log.log(interaction(i))
        wait_for(lambda: len(broker.received) == 10)
        time.sleep(0.3)  # several looks (retry_seconds 0.05)
        assert log.spooled == 0 and log.metrics.events.labels("interaction", "spooled")._value.get() == 0
    log.close()
    assert sorted(r[2] for r in broker.received) == [f"i{i}" for i in range(10, 20)]
    assert waiting.exists() and draining.exists()
    writer.close()


@pytest.mark.parametrize("pid", ["ours", "a dead one's"])
def test_a_gone_writers_segments_are_sent_whatever_process_id_they_carry(tmp_path, pid):
    """A writer counted as gone only when no process of its id ran on this host: replicas in containers
    sharing a spool are each pid 1 (and a pid is reused), so a dead replica's events stayed on disk, unsent,
    for as long as the live one ran."""
    broker = FakeBroker()
    log = make_log(tmp_path, broker)
    log.log(interaction(0))
    wait_for(lambda: len(broker.received) == 1)
    peer_segment(tmp_path, (1, 2, 3), alive=False, pid=os.getpid() if pid == "ours" else dead_pid())
    wait_for(lambda: len(broker.received) == 4)
    log.close()
    assert sorted(r[2] for r in broker.received) == ["i0", "i1", "i2", "i3"]
    assert events_log.Spool(tmp_path / "spool").pending() == 0
    assert not list((tmp_path / "spool").glob("*.writer")), "a gone writer's file goes with its last segment"


def test_a_segment_that_cannot_be_read_is_set_aside_and_the_rest_of_the_spool_is_sent(tmp_path, caplog):
    """An oldest segment that could not be opened (no permission, an I/O error; here a directory in its place)
    failed every sending pass before any other segment, so every new event was spooled behind it and none
    reached Kafka again, with a traceback five times a second."""
    broker = FakeBroker()
    broker.up = False
    older, _ = peer_segment(tmp_path, (1, 2), alive=False)
    blocked = older.with_name(older.name.replace("-", "-0", 1))  # sorts first: the oldest
    blocked.mkdir()
    log = make_log(tmp_path, broker)
    log.log(interaction(3))
    wait_for(lambda: log.spooled >= 3)  # Kafka away: spooled behind both segments
    broker.up = True
    wait_for(lambda: sorted(r[2] for r in broker.received) == ["i1", "i2", "i3"])
    log.close()
    assert not blocked.exists() and blocked.with_name(blocked.name + ".unreadable").is_dir()
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and blocked.name in errors[0] and "renamed" in errors[0], errors
    assert events_log.Spool(tmp_path / "spool").pending() == 0


def test_a_sent_segment_that_cannot_be_deleted_is_not_sent_again_and_again(tmp_path, monkeypatch, caplog):
    """A spool folder made read-only (a remount, an owner changed): each pass sent the segment whole and
    failed to delete it, so its events went to Kafka two to five times a second, for ever."""
    import pathlib

    broker = FakeBroker()
    segment, _ = peer_segment(tmp_path, (1, 2), alive=False)
    unlink = pathlib.Path.unlink

    def read_only(self, missing_ok=False):
        if self == segment:
            raise PermissionError(13, "Permission denied", str(self))
        return unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(pathlib.Path, "unlink", read_only)
    log = make_log(tmp_path, broker)
    wait_for(lambda: len(broker.received) == 2)
    log.log(interaction(3))
    wait_for(lambda: len(broker.received) == 3)
    time.sleep(0.3)  # several passes and looks (retry_seconds 0.05) that would send it again
    log.close()
    assert sorted(r[2] for r in broker.received) == ["i1", "i2", "i3"]
    assert segment.exists()
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "could not be deleted once sent" in errors[0], errors


def test_kafka_away_is_logged_once_and_then_once_a_minute_not_at_every_attempt(tmp_path, caplog):
    """A line at every connection attempt (every retry_seconds, 2 s by default) was ~43,000 a day per replica
    for as long as Kafka was away."""
    broker = FakeBroker()
    broker.up = False
    attempts = []

    def producer(bootstrap):
        attempts.append(1)
        return broker.producer(bootstrap)

    caplog.set_level("INFO", logger="serving.events_log")
    log = make_log(tmp_path, broker, producer)
    log.log(interaction(1))
    wait_for(lambda: len(attempts) >= 5)
    assert caplog.text.count("unreachable") == 1, caplog.text
    broker.up = True
    wait_for(lambda: len(broker.received) == 1)
    log.close()
    assert "connected to Kafka at fake:9092 again after" in caplog.text


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
    log = make_log(tmp_path, broker, lambda b: HangingProducer(broker), ack_timeout=30.0)
    log.log(interaction(0))
    wait_for(lambda: log._in_flight)  # the first batch is being sent: its flush would wait 30 s
    for i in range(1, 1200):  # more than one batch behind it
        log.log(interaction(i))
    log.close(timeout=3.0)
    assert not log._thread.is_alive(), "the thread still waits for the broker after close()"
    assert events_log.Spool(tmp_path / "spool").pending() == 1200  # every event logged is on disk
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
    log = make_log(tmp_path, broker, lambda b: broker.producer(b) and RefusingProducer(broker))
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
        log = make_log(tmp_path, broker, lambda b: RefusingProducer(broker))
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


def gated_log(tmp_path, broker, bound):
    GatedProducer.gate = threading.Event()
    return make_log(tmp_path, broker, lambda b: GatedProducer(broker), ack_timeout=30.0, queue_bytes=bound)


class FullDisk:
    """Makes `log`'s spool refuse every append (ENOSPC) while `full`; records each append's size."""

    def __init__(self, log):
        self.full = True
        self.attempts: list[int] = []
        append = log.spool.append

        def append_unless_full(messages):
            self.attempts.append(len(messages))
            if self.full:
                raise SpoolError("cannot append: [Errno 28] No space left on device")
            append(messages)

        log.spool.append = append_unless_full


def first_arrivals(broker):
    ids = [r[2] for r in broker.received]
    return sorted(set(ids), key=ids.index)


def test_past_its_bound_the_queue_goes_to_the_spool_in_order_and_nothing_is_lost(tmp_path, monkeypatch):
    monkeypatch.setattr(events_log, "ACK_SLICE", 0.02)  # the thread looks at the queue between slices
    broker = FakeBroker()
    bound = 2000  # bytes of event JSON: about 18 events
    log = gated_log(tmp_path, broker, bound)
    log.log(interaction(0))
    wait_for(lambda: log._in_flight)  # its send now waits for the gate
    for i in range(1, 300):
        log.log(interaction(i))
        # The thread spools the queue past the bound; waiting for it (a disk that keeps up) keeps this
        # test from ever reaching twice the bound, where log() drops.
        wait_for(lambda: log._queued_bytes <= bound and not log._spilling_bytes)
    wait_for(lambda: log.spool.pending() > 250)  # spilled to disk, the batch in flight with them
    GatedProducer.gate.set()
    wait_for(lambda: {r[2] for r in broker.received} == {f"i{i}" for i in range(300)} and log.spooled == 0)
    log.close()
    assert first_arrivals(broker) == [f"i{i}" for i in range(300)]
    assert len(broker.received) - 300 <= 1  # the batch in flight arrives twice: sent, and spilled
    assert log.metrics.events.labels("interaction", "dropped")._value.get() == 0


def test_log_never_writes_the_spool_and_close_keeps_what_was_queued(tmp_path, monkeypatch):
    monkeypatch.setattr(events_log, "ACK_SLICE", 0.05)
    broker = FakeBroker()
    log = gated_log(tmp_path, broker, 2000)
    writers = []
    append = log.spool.append
    appending, release, appended = threading.Event(), threading.Event(), threading.Event()

    def held_append(messages):  # an append takes a while (32 MiB took 0.24 s); the first one, until released
        writers.append(threading.current_thread().name)
        appending.set()
        release.wait(30)
        append(messages)
        appended.set()

    log.spool.append = held_append
    log.log(interaction(0))
    wait_for(lambda: log._in_flight)
    for i in range(1, 20):  # past the bound: the thread spools the queue
        log.log(interaction(i))
    assert appending.wait(10), "the queue past its bound was not spooled"
    for i in range(20, 30):  # while that append is under way (below twice the bound: nothing dropped)
        assert log.log(interaction(i)) is True
    assert not appended.is_set(), "log() waited for the spool's append"
    release.set()
    log.close(timeout=4.0)  # the broker never answers: everything ends in the spool
    assert set(writers) == {"clora-event-log"}
    assert log.metrics.events.labels("interaction", "dropped")._value.get() == 0
    again = make_log(tmp_path, broker)
    wait_for(lambda: len({r[2] for r in broker.received}) == 30)
    again.close()
    assert first_arrivals(broker) == [f"i{i}" for i in range(30)]


def test_a_failed_spill_keeps_the_queue_drops_only_past_twice_the_bound_and_waits_before_trying_again(
        tmp_path, monkeypatch):
    monkeypatch.setattr(events_log, "ACK_SLICE", 0.02)
    monkeypatch.setattr(events_log, "SPILL_RETRY", 3.0)  # well past the 0.2 s below, on a slow machine too
    broker = FakeBroker()
    bound = 2000  # twice the bound holds 36 events (110-111 bytes each)
    log = gated_log(tmp_path, broker, bound)
    disk = FullDisk(log)
    attempts = disk.attempts
    log.log(interaction(0))
    wait_for(lambda: log._in_flight)
    for i in range(1, 100):  # past twice the bound the newest are dropped
        log.log(interaction(i))
    wait_for(lambda: attempts and log._spilling_bytes == 0)  # tried, failed, the queue is back
    for i in range(100, 120):  # still at twice the bound: dropped, and the caller is told
        assert log.log(interaction(i)) is False
    time.sleep(0.2)
    assert len(attempts) == 1  # no new attempt within SPILL_RETRY
    disk.full = False  # after SPILL_RETRY the thread spools the queue again, unasked
    wait_for(lambda: len(attempts) == 2 and log._spilling_bytes == 0 and log.spooled)
    for i in range(120, 130):
        assert log.log(interaction(i)) is True
    GatedProducer.gate.set()
    wait_for(lambda: log.spooled == 0 and "i129" in {r[2] for r in broker.received})
    log.close()
    ids = [int(a[1:]) for a in first_arrivals(broker)]
    kept = ids.index(120)
    assert ids == list(range(kept)) + list(range(120, 130))  # the queue the failed spill held is all there
    assert kept == 37  # i0 in flight and i1..i36; before, a failed spill threw the queue away
    assert log.metrics.events.labels("interaction", "dropped")._value.get() == 120 - kept


class SlowAckProducer(FakeProducer):
    """Acknowledges after 10 ms: a broker a little way off."""

    def flush(self, timeout=None):
        time.sleep(0.01)


def test_after_a_backlog_steady_traffic_goes_straight_to_kafka_again(tmp_path):
    broker = FakeBroker()
    broker.up = False
    log = make_log(tmp_path, broker, lambda b: broker.producer(b) and SlowAckProducer(broker))
    for i in range(50):
        log.log(interaction(i))
    wait_for(lambda: log.spooled == 50)
    broker.up = True
    for i in range(50, 450):  # about 400 events/s while the backlog is resent, and after
        log.log(interaction(i))
        time.sleep(0.0025)
    wait_for(lambda: len({r[2] for r in broker.received}) == 450 and log.spooled == 0)
    log.close()
    assert first_arrivals(broker) == [f"i{i}" for i in range(450)]
    events = log.metrics.events
    assert events.labels("interaction", "resent")._value.get() < 150  # the backlog, and a little traffic
    assert events.labels("interaction", "sent")._value.get() > 300  # not an fsync per event for ever


def test_with_kafka_away_a_spool_that_refuses_events_keeps_them_queued_in_order(tmp_path, monkeypatch):
    monkeypatch.setattr(events_log, "SPILL_RETRY", 0.2)
    broker = FakeBroker()
    broker.up = False
    log = make_log(tmp_path, broker)
    disk = FullDisk(log)
    attempts = disk.attempts
    for i in range(10):
        log.log(interaction(i))
    wait_for(lambda: len(attempts) >= 2)  # refused, waited SPILL_RETRY, refused again
    disk.full = False
    wait_for(lambda: log.spooled == 10)
    broker.up = True
    wait_for(lambda: len(broker.received) == 10)
    log.close()
    assert [r[2] for r in broker.received] == [f"i{i}" for i in range(10)]
    assert log.metrics.events.labels("interaction", "dropped")._value.get() == 0


def test_a_batch_in_flight_is_bounded_by_bytes_too(tmp_path, monkeypatch):
    monkeypatch.setattr(events_log, "BATCH_BYTES", 1000)
    broker = FakeBroker()
    log = make_log(tmp_path, broker, start=False)
    sizes = []
    handle = log._handle

    def recording(batch):
        sizes.append(sum(len(m.value) for m in batch))
        handle(batch)

    log._handle = recording
    big = "x" * 600
    for i in range(6):  # all queued before the thread starts: one batch, were it not for the byte bound
        log.log(InteractionEvent(id=f"i{i}", tenant="acme", completion=big, prompt="p"))
    log.start()
    wait_for(lambda: len(broker.received) == 6)
    log.close()
    assert all(size < 2 * 1000 for size in sizes), sizes  # at most one event past the byte bound


class HeldProducer(FakeProducer):
    """A broker that answers only once `go` is set (the first send waits for it)."""

    def __init__(self, broker, go):
        super().__init__(broker)
        self.go = go

    def send(self, topic, key, value):
        self.go.wait(30)
        return super().send(topic, key, value)


def test_a_full_disk_does_not_throttle_the_resend_of_a_backlog(tmp_path, monkeypatch):
    """Kafka back while the spool's disk is full (the spool filled it): the segments are sent at Kafka's pace,
    and what comes in meanwhile stays queued instead of costing a SPILL_RETRY wait per segment."""
    monkeypatch.setattr(events_log, "SPILL_RETRY", 600.0)  # a wait of it would outlast the test by far
    broker = FakeBroker()
    broker.up = False
    go = threading.Event()
    log = make_log(tmp_path, broker, lambda b: broker.producer(b) and HeldProducer(broker, go), start=False)
    log.spool = events_log.Spool(tmp_path / "spool", segment_bytes=300)  # a segment every few events
    log.start()
    for i in range(20):  # one append each: several segments
        log.log(interaction(i))
        wait_for(lambda: log.spooled == i + 1)
    log.spool.seal()
    assert len(list(log.spool.segments())) >= 5
    log.spool.append = lambda messages: (_ for _ in ()).throw(SpoolError("[Errno 28] No space left on device"))
    broker.up = True
    wait_for(lambda: log.connected)  # the resend began: its first segment's send waits for `go`
    for i in range(20, 30):  # traffic during the resend: queued, and the spool refuses it before the next segment
        log.log(interaction(i))
    go.set()
    wait_for(lambda: len(broker.received) == 30, timeout=30)
    log.close()
    assert [r[2] for r in broker.received] == [f"i{i}" for i in range(30)]


# --- a broker that is up but slow: the spool drains a piece at a time ---------------------------------------


class TricklingProducer(FakeProducer):
    """A broker that is up but slow: each wait for acknowledgements (`flush`) acknowledges the `per_await`
    oldest messages still pending, in order, then (if any are left) waits out its timeout and gives up.
    Ids in `held` are never acknowledged; a completion "BIG" is refused for good when its turn comes."""

    def __init__(self, broker, per_await, held=()):
        super().__init__(broker)
        self.per_await = per_await
        self.held = set(held)
        self.pending = []

    def send(self, topic, key, value):
        future = FakeFuture(False)
        future.is_done = False
        event = json.loads(value)
        self.pending.append((future, (topic, key.decode(), event["id"]), event.get("completion") == "BIG"))
        return future

    def flush(self, timeout=None):
        from kafka.errors import MessageSizeTooLargeError

        turn = [p for p in self.pending if p[1][2] not in self.held][:self.per_await]
        for future, record, big in turn:
            if big:
                future.exception = MessageSizeTooLargeError("the broker's limit is 1048588 bytes")
            else:
                with self.broker.lock:
                    self.broker.received.append(record)
                future._ok = True
            future.is_done = True
        self.pending = [p for p in self.pending if not p[0].is_done]
        if self.pending:
            time.sleep(timeout)  # one flush per wait for acknowledgements
            raise TimeoutError(f"{len(self.pending)} messages not acknowledged within {timeout}s")


def spool_left_behind(tmp_path, events, **spool_settings):
    """The spool an earlier run left: `events` in one append."""
    spool = events_log.Spool(tmp_path / "spool", **spool_settings)
    spool.append([events_log.Message("t.interactions", e.tenant, encode(e).decode()) for e in events])
    spool.close()


def slow_log(tmp_path, broker, producer_factory):
    """An event log driven by hand (no thread): every `try_spool` reconnects and sends the spool once, as the
    thread does every retry_seconds; a wait for acknowledgements is one flush of the producer."""
    log = make_log(tmp_path, broker, producer_factory, start=False, ack_timeout=0.01)
    log.retry_seconds = 0
    return log


def try_spool(log, tries):
    """Sends the spool up to `tries` times; how many it took to empty it (None: not emptied)."""
    for n in range(1, tries + 1):
        if log._connect():
            log._send_spool()
        if log.spooled == 0:
            return n
    return None


def test_a_slow_broker_drains_a_segment_a_piece_at_a_time_each_event_once(tmp_path):
    """A broker acknowledging 50 messages per ack_timeout, a segment of 400: before, every try resent the
    segment from its start, the same first 50 arrived again and again, and the spool never shrank."""
    broker = FakeBroker()
    spool_left_behind(tmp_path, [interaction(i) for i in range(400)])
    log = slow_log(tmp_path, broker, lambda b: TricklingProducer(broker, per_await=50))
    assert log.spooled == 400
    assert try_spool(log, 20) == 400 // 50  # each try goes on where the last one's acknowledgements ended
    assert [r[2] for r in broker.received] == [f"i{i}" for i in range(400)]  # each once, in order
    assert list((tmp_path / "spool").iterdir()) == []  # the segment and its progress record are gone
    assert log.metrics.events.labels("interaction", "resent")._value.get() == 400


def test_the_progress_through_a_segment_survives_a_crash(tmp_path):
    broker = FakeBroker()
    spool_left_behind(tmp_path, [interaction(i) for i in range(400)])
    crashing = slow_log(tmp_path, broker, lambda b: TricklingProducer(broker, per_await=150))
    assert try_spool(crashing, 1) is None  # one try, 150 acknowledged; then the process dies (no close)
    assert crashing.spooled == 250
    again = slow_log(tmp_path, broker, broker.producer)  # the next process, the broker fast again
    assert again.spooled == 250
    assert try_spool(again, 1) == 1
    assert [r[2] for r in broker.received] == [f"i{i}" for i in range(400)]  # none acknowledged twice


def test_a_missing_acknowledgement_ends_the_prefix_so_nothing_behind_it_is_skipped(tmp_path):
    """Kafka acknowledges partitions independently: i3 unacknowledged while i4.. are. The next try starts at
    i3; what was acknowledged behind it comes again (bounded duplicates), what came before it does not."""
    broker = FakeBroker()
    spool_left_behind(tmp_path, [interaction(i) for i in range(10)])
    producers = iter([TricklingProducer(broker, per_await=100, held={"i3"})])
    log = slow_log(tmp_path, broker, lambda b: next(producers, None) or TricklingProducer(broker, per_await=100))
    assert try_spool(log, 5) == 2
    ids = [r[2] for r in broker.received]
    assert ids == [f"i{i}" for i in [0, 1, 2, 4, 5, 6, 7, 8, 9, 3, 4, 5, 6, 7, 8, 9]]


def test_a_refused_event_in_a_slowly_drained_segment_is_dead_lettered_once(tmp_path):
    broker = FakeBroker()
    big = InteractionEvent(id="big", tenant="acme", completion="BIG", prompt="p")
    spool_left_behind(tmp_path, [interaction(0), big, *(interaction(i) for i in range(1, 10))])
    log = slow_log(tmp_path, broker, lambda b: TricklingProducer(broker, per_await=3))
    assert try_spool(log, 20) == 4  # 11 messages, 3 a try
    assert [r[2] for r in broker.received] == [f"i{i}" for i in range(10)]
    assert [json.loads(d["value"])["id"] for d in dead_letters(tmp_path)] == ["big"]
    assert [p.name for p in (tmp_path / "spool").iterdir()] == ["dead"]


def test_a_spill_larger_than_a_segment_makes_several_segments(tmp_path):
    """The queue past its bound goes to the spool in one append; before, that made one segment of the whole
    queue (32 MiB and more with the defaults), sent and resent only as a whole."""
    broker = FakeBroker()
    log = make_log(tmp_path, broker, start=False, queue_bytes=2000)
    log.spool = events_log.Spool(tmp_path / "spool", segment_bytes=1000)
    for i in range(30):  # 3,300 bytes of events: past the bound, below twice it
        assert log.log(interaction(i))
    log._spill_if_full()
    assert not log._queue and log.spooled == 30
    log.spool.seal()
    sizes = [p.stat().st_size for p in log.spool.segments()]
    assert len(sizes) >= 5 and max(sizes) <= 1000, sizes
    assert try_spool(log, 1) == 1
    assert [r[2] for r in broker.received] == [f"i{i}" for i in range(30)]


def test_a_spill_that_fails_part_way_keeps_only_the_rest_queued(tmp_path, monkeypatch):
    import os

    import serving.spool as spool_module

    broker = FakeBroker()
    log = make_log(tmp_path, broker, start=False, queue_bytes=2000)
    log.spool = events_log.Spool(tmp_path / "spool", segment_bytes=1000)
    for i in range(30):
        log.log(interaction(i))
    real_write, writes = os.write, []

    def write(fd, data):  # the disk fills at the spill's second segment
        writes.append(len(data))
        if len(writes) == 2:
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(spool_module.os, "write", write)
    log._spill_if_full()
    monkeypatch.undo()
    spooled = log.spooled
    assert 0 < spooled < 30 and len(log._queue) == 30 - spooled  # nothing written twice, nothing lost
    assert [json.loads(m.value)["id"] for m in log._queue] == [f"i{i}" for i in range(spooled, 30)]
    assert log._queued_bytes == sum(len(m.value) for m in log._queue)
    log.start()
    wait_for(lambda: len(broker.received) == 30 and log.spooled == 0)
    log.close()
    assert [r[2] for r in broker.received] == [f"i{i}" for i in range(30)]


def test_a_wait_for_acknowledgements_that_starts_late_still_looks_once(tmp_path):
    """A thread held up (a busy machine) past the whole ack_timeout before its first look gave up without
    looking: answers already there were taken for none, and the batch was sent again."""
    broker = FakeBroker()
    log = make_log(tmp_path, broker, start=False, ack_timeout=0.01)
    looks = []

    class FakeProducerCountingLooks(FakeProducer):
        def flush(self, timeout=None):
            looks.append(timeout)

    log._spill_if_full = lambda: time.sleep(0.05)  # held up past ack_timeout before the first look
    log._await_acks(FakeProducerCountingLooks(broker))  # every answer is in: no TimeoutError
    assert looks == [0.0]
    log.close()
