"""The dead-letter topic, best effort beside dead_letters/ in Parquet: what reaches it, and what becomes of a
batch when it does not answer. Giving up on it is logged and counted, never raised: the batch is committed,
and its dead letters are in Parquet either way.

Kafka's clients are fakes (kafka_fakes.FakeConsumer records commits; FakeDeadLetterProducer below records
sends and answers them as a test says); the processing, the Parquet writes and the store view are the real
ones. The topic that cannot be reached at all is in test_rebalance.py.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from kafka import TopicPartition
from kafka.errors import KafkaTimeoutError, NotEnoughReplicasError
from kafka_fakes import FakeConsumer

import ingest.consumer as consumer_module
from ingest.batch import Processor, Record
from ingest.consumer import DEAD_LETTER_ATTEMPTS, Ingest
from ingest.events import InteractionEvent, encode
from ingest.metrics import IngestMetrics
from ingest.pending import PendingStore
from storage.parquet import read_dataset

pytestmark = pytest.mark.unit

PARTITION = TopicPartition("t.i", 0)
LONE_SURROGATE = json.loads('"\\ud83d oops"')  # JSON's escape of half an emoji: a str no UTF-8 encodes


def surrogate_error_scorer(completion, prompt):
    raise ValueError(f"no number: {LONE_SURROGATE}")


class FakeSendFuture:
    """What kafka-python's send() returns: `get` gives the broker's answer, an error raised."""

    def __init__(self, error: Exception | None):
        self.error = error

    def get(self, timeout=None):
        if self.error is not None:
            raise self.error
        return "metadata"


class FakeDeadLetterProducer:
    """Stands in for KafkaProducer: records each send as (topic, key, value, headers as a dict of bytes).
    `flush_times_out`: flush() raises as kafka-python's does when sends are still unanswered at its timeout
    (they are answered later); `refuse`: the error every send is answered with (None: acknowledged)."""

    def __init__(self, *, flush_times_out: bool = False, refuse: Exception | None = None):
        self.flush_times_out = flush_times_out
        self.refuse = refuse
        self.sent: list[tuple] = []

    def send(self, topic, *, key, value, headers):
        headers = dict(headers)
        self.sent.append((topic, key, value, headers))
        return FakeSendFuture(self.refuse)

    def flush(self, timeout=None):
        if self.flush_times_out:
            raise KafkaTimeoutError(f"Timeout after waiting for {timeout} secs.")


@pytest.fixture
def ingest(data_dir, monkeypatch):
    monkeypatch.setattr(consumer_module, "DEAD_LETTER_BACKOFF_SECONDS", 0.0)
    processor = Processor({"acme": "inline", "sur": f"python:{__name__}:surrogate_error_scorer"},
                          unknown_tenant="reject", max_message_bytes=10_000)
    ing = Ingest(root=str(data_dir), bootstrap="unused:9092", interactions_topic="t.i", feedback_topic="t.f",
                 dead_letter_topic="t.d", group_id="g", processor=processor, flush_rows=100, flush_seconds=1.0,
                 expiry_ms=3_600_000, session_timeout_ms=10_000, heartbeat_interval_ms=3_000, metrics=IngestMetrics())
    ing.consumer = FakeConsumer({PARTITION})
    ing.store = PendingStore.load(str(data_dir), expiry_ms=ing.expiry_ms, now_ms=0)
    ing.writer = ThreadPoolExecutor(max_workers=2)
    yield ing
    ing.writer.shutdown(wait=True)


def batch(*, to_reject: bytes = b"{}") -> list[Record]:
    """A good interaction, then two messages to dead-letter (offsets 1 and 2)."""
    return [Record("t.i", 0, 0, encode(InteractionEvent(id="ok", tenant="acme", prompt="p", completion="c"))),
            Record("t.i", 0, 1, b"not json"),
            Record("t.i", 0, 2, to_reject)]


def test_a_scorer_error_quoting_a_lone_surrogate_reaches_the_topic_with_the_others(ingest, data_dir):
    """Its clora.detail header could not be encoded: UnicodeEncodeError gave up on every dead letter of the
    batch (and the Parquet write failed first, again at every replay)."""
    ingest.producer = FakeDeadLetterProducer()
    ingest.buffer = batch(to_reject=encode(InteractionEvent(id="s", tenant="sur", prompt="p", completion="c")))
    ingest.flush()
    sent = [(topic, key, headers["clora.reason"]) for topic, key, _, headers in ingest.producer.sent]
    assert sent == [("t.d", b"_unknown", b"not_json"), ("t.d", b"sur", b"scorer_error")]
    detail = ingest.producer.sent[1][3]["clora.detail"]
    assert b"ValueError: no number: \\ud83d oops" in detail
    assert read_dataset(str(data_dir), "dead_letters").num_rows == 2
    assert ingest.consumer.commits == [{PARTITION: 3}]
    assert ingest.metrics.total["dead_letters_not_delivered"] == 0


def test_a_flush_that_times_out_leaves_each_send_to_its_own_answer(ingest, data_dir, caplog):
    """producer.flush() raised KafkaTimeoutError out of the dead letters' task, and ingest stopped with the
    batch uncommitted. Sends answered after the flush gave up are acknowledged: not sent again."""
    ingest.producer = FakeDeadLetterProducer(flush_times_out=True)
    ingest.buffer = batch()
    ingest.flush()
    assert len(ingest.producer.sent) == 2, "an acknowledged dead letter was sent again"
    assert ingest.consumer.commits == [{PARTITION: 3}]
    assert ingest.metrics.total["dead_letters_not_delivered"] == 0
    assert "could not be sent" not in caplog.text


def test_dead_letters_the_topic_never_acknowledges_are_given_up_counted_and_the_batch_committed(ingest, data_dir, caplog):
    """Best effort: after DEAD_LETTER_ATTEMPTS sends the batch is committed anyway, so those messages never
    reach the topic; that was logged only. They are in dead_letters/, and now counted."""
    ingest.producer = FakeDeadLetterProducer(refuse=NotEnoughReplicasError("not enough replicas"))
    ingest.buffer = batch()
    ingest.flush()
    assert len(ingest.producer.sent) == 2 * DEAD_LETTER_ATTEMPTS
    assert ingest.consumer.commits == [{PARTITION: 3}]
    assert read_dataset(str(data_dir), "dead_letters").num_rows == 2
    assert "2 of 2 dead letters could not be sent to t.d" in caplog.text
    assert ingest.metrics.total["dead_letters_not_delivered"] == 2
    assert ingest.metrics.registry.get_sample_value("clora_ingest_dead_letters_not_delivered_total") == 2


def test_after_giving_up_on_the_topic_the_next_batches_do_not_wait_for_it(ingest, data_dir, caplog):
    """A dead-letter topic that does not answer held each batch with a dead letter for every attempt (about a
    minute, or 10 s a batch for a missing topic): ingest crawled. For DEAD_LETTER_PAUSE_S after giving up, the
    dead letters are kept in Parquet only, counted as not delivered, and the batch is committed at once."""
    ingest.producer = FakeDeadLetterProducer(refuse=NotEnoughReplicasError("not enough replicas"))
    ingest.buffer = batch()
    ingest.flush()
    assert len(ingest.producer.sent) == 2 * DEAD_LETTER_ATTEMPTS
    ingest.buffer = [Record("t.i", 0, 3, b"still not json")]
    ingest.flush()
    assert len(ingest.producer.sent) == 2 * DEAD_LETTER_ATTEMPTS, "sent to the topic while it was paused"
    assert ingest.consumer.commits == [{PARTITION: 3}, {PARTITION: 4}]
    assert read_dataset(str(data_dir), "dead_letters").num_rows == 3
    assert ingest.metrics.total["dead_letters_not_delivered"] == 3
    ingest._dead_letter_pause_until = 0.0  # the pause over: the topic is tried again
    ingest.producer.refuse = None
    ingest.buffer = [Record("t.i", 0, 4, b"junk again")]
    ingest.flush()
    assert ingest.producer.sent[-1][2] == b"junk again"
