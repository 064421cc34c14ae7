"""What one ingest process does when the group moves on without it: a commit the group refuses, and
partitions lost to an eviction; and when the dead-letter topic cannot be reached. Nothing more is written or committed on the stale view; what was dropped
is read again (this process seeks back) or replayed by the partitions' next owner.

The consumer is a fake (kafka_fakes.FakeConsumer: it records commits and seeks, and refuses commits on
demand); the processing, the Parquet writes and the store view are the real ones. The real broker's rebalances are in
test_ingest_process.py (two processes in one group, one killed).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from kafka import TopicPartition
from kafka_fakes import FakeConsumer, FakeConsumerRecord

import ingest.pending as pending
from ingest.batch import Processor, Record
from ingest.consumer import Ingest
from ingest.events import FeedbackEvent, InteractionEvent, encode
from ingest.metrics import IngestMetrics
from ingest.pending import PendingStore
from storage.parquet import read_dataset

pytestmark = pytest.mark.unit


def records(partition, first, n):
    return [Record("t.i", partition, first + k, encode(InteractionEvent(id=f"p{partition}-{first + k}", tenant="acme",
                                                                            prompt="p", completion="c")))
            for k in range(n)]


@pytest.fixture
def ingest(data_dir):
    ing = Ingest(root=str(data_dir), bootstrap="unused:9092", interactions_topic="t.i", feedback_topic="t.f",
                 dead_letter_topic="t.d", group_id="g", processor=Processor({"acme": "inline"}, unknown_tenant="reject", max_message_bytes=10_000),
                 flush_rows=100, flush_seconds=1.0, expiry_ms=3_600_000, session_timeout_ms=10_000,
                 heartbeat_interval_ms=3_000, metrics=IngestMetrics())
    ing.consumer = FakeConsumer({TopicPartition("t.i", 0)})  # partition 1 already moved to another process
    ing.store = PendingStore.load(str(data_dir), expiry_ms=ing.expiry_ms, now_ms=0)
    ing.writer = ThreadPoolExecutor(max_workers=2)
    yield ing
    ing.writer.shutdown(wait=True)


def stored_ids(data_dir):
    return sorted(read_dataset(str(data_dir), "interactions").column("id").to_pylist())


@pytest.mark.parametrize("refusal", [True, "timeout"], ids=["group moved on", "broker did not answer"])
def test_a_refused_commit_stops_writing_and_seeks_back_to_what_it_dropped(ingest, data_dir, refusal):
    """A commit the broker did not answer within its timeout ended ingest with a traceback: it is a commit
    not made, as one the group refused."""
    ingest.buffer = records(0, 0, 3)
    ingest._start_flush()  # batch 1 is being written
    ingest.buffer = records(0, 3, 2) + records(1, 10, 2)
    ingest.consumer.refuse = refusal
    ingest._start_flush()  # batch 2 is decided, then batch 1's commit is refused: batch 2 must not be written
    assert ingest.writing is None and ingest.buffer == [] and ingest.store is None
    assert stored_ids(data_dir) == ["p0-0", "p0-1", "p0-2"]  # batch 1 is durable (its replay is deduplicated)
    assert ingest.consumer.commits == []
    # partition 0 is read again from batch 2's first offset; partition 1's new owner replays it
    assert ingest.consumer.seeks == [(TopicPartition("t.i", 0), 3)]


def test_a_refused_commit_with_nothing_decided_drops_the_buffer(ingest, data_dir):
    ingest.buffer = records(0, 0, 2)
    ingest._start_flush()
    ingest.buffer = records(0, 2, 4)  # polled while batch 1 was written
    ingest.consumer.refuse = True
    assert not ingest._finish_write()
    ingest._drop_uncommitted({}, "the group refused a commit")
    assert ingest.buffer == [] and ingest.store is None
    assert ingest.consumer.seeks == [(TopicPartition("t.i", 0), 2)]
    assert stored_ids(data_dir) == ["p0-0", "p0-1"]


def test_lost_partitions_are_not_written_to_nor_committed(ingest, data_dir):
    ingest.buffer = records(0, 0, 3)
    ingest._start_flush()  # being written when the eviction is noticed: it cannot be stopped
    ingest.buffer = records(0, 3, 5)
    ingest.lost([TopicPartition("t.i", 0)])
    assert ingest.writing is None and ingest.buffer == [] and ingest.store is None
    assert stored_ids(data_dir) == ["p0-0", "p0-1", "p0-2"]  # waited for, so it does not land later still
    assert ingest.consumer.commits == []  # the new owner commits; this process may not
    ingest._start_flush()  # nothing left to write
    assert stored_ids(data_dir) == ["p0-0", "p0-1", "p0-2"]


def test_after_a_normal_batch_the_commit_goes_through(ingest, data_dir):
    ingest.buffer = records(0, 0, 2)
    ingest.flush()
    assert ingest.consumer.commits == [{TopicPartition("t.i", 0): 2}] and ingest.consumer.seeks == []
    assert stored_ids(data_dir) == ["p0-0", "p0-1"] and ingest.store is not None


def test_a_revocation_finishes_the_write_in_flight_uncommitted_and_leaves_the_buffer_for_replay(ingest, data_dir,
                                                                                                 monkeypatch):
    ingest.buffer = records(0, 0, 3)
    ingest._start_flush()  # batch 1 is being written
    ingest.buffer = records(0, 3, 2)  # polled meanwhile
    ingest.consumer.in_callback = True
    # Not processed in the callback: that runs on kafka-python's network thread, where scorers have no limit.
    monkeypatch.setattr(ingest.processor, "process", lambda *a: pytest.fail("processed in a rebalance callback"))
    ingest.revoked([TopicPartition("t.i", 0)])  # as kafka-python calls it: a commit here would raise
    monkeypatch.undo()
    assert ingest.writing is None and ingest.buffer == [] and ingest.store is None
    assert stored_ids(data_dir) == ["p0-0", "p0-1", "p0-2"] and ingest.consumer.commits == []
    # kafka-python keeps the position of a partition this process keeps: it goes back to where the buffer began.
    assert ingest.consumer.seeks == [(TopicPartition("t.i", 0), 3)]
    ingest.assigned([TopicPartition("t.i", 0)])
    # The partition comes back from its last commit: the replay is skipped, what follows is stored, and the
    # loop's commit covers both.
    ingest.consumer.in_callback = False
    ingest.load_store()
    ingest.buffer = records(0, 0, 7)
    ingest.flush()
    assert stored_ids(data_dir) == [f"p0-{k}" for k in range(7)]
    assert ingest.consumer.commits == [{TopicPartition("t.i", 0): 7}]


class FakeNoTopicProducer:
    """Stands in for KafkaProducer when the dead-letter topic does not exist and the cluster does not create
    topics: kafka-python's send() raises once max_block_ms pass without the topic's metadata."""

    def __init__(self):
        self.sends = 0

    def send(self, topic, **kwargs):
        from kafka.errors import KafkaTimeoutError

        self.sends += 1
        raise KafkaTimeoutError(f"Failed to update metadata after 10.0 secs (topic {topic})")

    def flush(self):
        pass


def test_a_dead_letter_topic_that_cannot_be_reached_does_not_stop_ingest(ingest, data_dir, caplog):
    ingest.producer = FakeNoTopicProducer()
    ingest.buffer = records(0, 0, 2) + [Record("t.i", 0, 2, b"not json"), Record("t.i", 0, 3, b"{}")]
    ingest.flush()  # the dead letters' task gave up (logged), so the batch commits
    assert stored_ids(data_dir) == ["p0-0", "p0-1"] and len(read_dataset(str(data_dir), "dead_letters")) == 2
    assert ingest.consumer.commits == [{TopicPartition("t.i", 0): 4}]
    assert ingest.producer.sends == 1, "the other dead letters would each wait as long: given up at once"
    assert "2 of 2 dead letters could not be sent to t.d" in caplog.text


# ---------------------------------------------------------------------------------------------------------
# The interactions index's rebuild (pending.py, shrink_files) runs in the loop, never in a listener


class FakeLoopConsumer(FakeConsumer):
    """What `Ingest._loop` asks of a consumer. `poll` hands out `batches` so that each is one write: a batch
    when nothing is buffered or in flight, then nothing (the loop, caught up, flushes it), then nothing once
    its write is done (the loop commits it). With all handed out and written it sets `stop`."""

    def __init__(self, ingest, batches, stop):
        super().__init__({TopicPartition("t.i", 0)})
        self.ingest, self.batches, self.stop = ingest, list(batches), stop

    def poll(self, timeout_ms, max_records):
        if self.ingest.writing is not None:
            while not self.ingest.writing.done():
                time.sleep(0.005)
            return {}
        if self.ingest.buffer:
            return {}
        if not self.batches:
            self.stop.set()
            return {}
        return {TopicPartition("t.i", 0): [FakeConsumerRecord(r.topic, r.partition, r.offset, r.value, r.key)
                                           for r in self.batches.pop(0)]}


@pytest.fixture
def shrinks(ingest, data_dir, monkeypatch):
    """Every call of PendingStore._shrink_files, as whether a rebalance callback was running; a fresh store
    whose file list is due for a look after its first write (RELOAD_MIN_FILES = 1)."""
    monkeypatch.setattr(pending, "RELOAD_MIN_FILES", 1)
    calls, in_callback = [], []
    real = PendingStore._shrink_files
    monkeypatch.setattr(PendingStore, "_shrink_files", lambda store: (calls.append(bool(in_callback)), real(store))[1])
    for name in ("revoked", "assigned", "lost"):
        callback = getattr(ingest, name)

        def listener(partitions, callback=callback):
            in_callback.append(1)
            try:
                callback(partitions)
            finally:
                in_callback.pop()

        monkeypatch.setattr(ingest, name, listener)
    ingest.load_store = lambda: setattr(ingest, "store", PendingStore.load(str(data_dir), expiry_ms=ingest.expiry_ms, now_ms=0))
    ingest.load_store()
    return calls


@pytest.mark.parametrize("callback", ["revoked", "assigned", "lost"])
def test_the_interactions_index_is_not_rebuilt_inside_a_rebalance_callback(ingest, data_dir, shrinks, callback):
    """Finishing the write in flight inside a listener used to rebuild the index there (it reads every stored
    interaction id while the group waits), for a view dropped right after."""
    ingest.buffer = records(0, 0, 3)
    ingest._start_flush()  # in flight when the rebalance comes
    ingest.buffer = records(0, 3, 2)
    getattr(ingest, callback)([TopicPartition("t.i", 0)])
    assert ingest.writing is None and ingest.store is None
    assert stored_ids(data_dir)[:3] == ["p0-0", "p0-1", "p0-2"]
    assert shrinks == []


def test_the_loop_looks_at_the_file_list_after_its_commits(ingest, data_dir, shrinks):
    """... and the loop still does it, after a commit, when the list is due (after writes 1 and 2 here: the
    next look is due once the list has grown by the live files since)."""
    stop = threading.Event()
    ingest.consumer = FakeLoopConsumer(ingest, [records(0, 0, 3), records(0, 3, 3), records(0, 6, 3)], stop)
    ingest._loop(stop, once=False, deadline=time.monotonic() + 60, drain=threading.Event())
    assert stop.is_set() and len(ingest.consumer.commits) == 3
    assert stored_ids(data_dir) == sorted(f"p0-{i}" for i in range(9))
    assert shrinks == [False, False]
    ingest.buffer = records(0, 9, 2)
    ingest._start_flush()
    ingest.revoked([TopicPartition("t.i", 0)])  # a look is due when this write lands: not taken there
    assert shrinks == [False, False] and stored_ids(data_dir) == sorted(f"p0-{i}" for i in range(11))
    assert len(ingest.consumer.commits) == 3  # written, not committed there (see Ingest.revoked)


# ---------------------------------------------------------------------------------------------------------
# A process the group gives no partition (more processes than partitions)


class FakeEmptyGroupConsumer(FakeConsumer):
    """A fake group member: its polls come back empty, and the `join_at`th poll completes the group's
    rebalance with no partition for this member (the listener's on_partitions_assigned with an empty list)."""

    def __init__(self, ingest, join_at):
        super().__init__(set())
        self.ingest, self.join_at, self.polls = ingest, join_at, 0

    def poll(self, timeout_ms, max_records):
        self.polls += 1
        if self.polls == self.join_at:
            self.ingest.assigned([])
        return {}


def test_once_exits_when_the_group_gives_this_process_no_partition(ingest, data_dir, caplog):
    """`--once` (and a drain on stop) waited for ever in a process with no partition: it only ever checked
    that assigned partitions were read to their end. Before the group's answer it must not exit (its
    partitions may be on their way); after an empty assignment it has nothing to read."""
    ingest.store = None
    ingest.consumer = FakeEmptyGroupConsumer(ingest, join_at=3)
    stop = threading.Event()
    with caplog.at_level("INFO", logger="ingest.consumer"):
        ingest._loop(stop, once=True, deadline=time.monotonic() + 30, drain=threading.Event())
    assert "every assigned partition is read to its end (--once)" in caplog.text, "left by --max-seconds"
    (idle,) = [r for r in caplog.records if "no partition assigned" in r.getMessage()]
    assert idle.levelname == "WARNING" and "more members than the topics have partitions" in idle.getMessage()
    assert ingest.consumer.polls == 3
    assert (data_dir / "state" / "ready" / "ingest.json").exists()  # in the group: `clora up` may go on
    assert ingest.store is None  # no partition: no store view to load


def test_a_revocation_makes_once_wait_for_the_next_assignment(ingest):
    ingest.consumer = FakeEmptyGroupConsumer(ingest, join_at=1)
    ingest.assigned([])
    ingest.revoked([])
    assert not ingest.drained()
    ingest.assigned([])
    assert ingest.drained()


def test_a_store_loaded_after_a_restart_holds_no_feedback_of_tenants_a_function_scores(ingest, data_dir):
    """Their feedback scores nothing (kept in feedback/ only); loaded into the join it only took room."""
    ingest.processor = Processor({"acme": "inline", "dig": "digits"}, unknown_tenant="reject", max_message_bytes=10_000)
    ingest.buffer = [Record("t.f", 0, k, encode(FeedbackEvent(id=f"i{k}", tenant=tenant, score=0.5)))
                     for k, tenant in enumerate(["acme", "dig"])]
    ingest.flush()
    assert sorted(read_dataset(str(data_dir), "feedback").column("tenant").to_pylist()) == ["acme", "dig"]
    ingest.load_store()
    assert sorted(ingest.store.pending) == [("acme", "i0")]


def test_the_store_view_after_an_assignment_waits_the_feedback_of_the_feedback_partitions_assigned(ingest, data_dir):
    """Each process in the group loads the pending feedback of its own feedback partitions only (pending.py,
    OwnedPartitions), whichever partitions of the interactions topic it has, as the client's metadata gives
    the topic's count; without that metadata, all of it."""
    from types import SimpleNamespace

    ingest.buffer = [Record("t.f", partition, k, encode(FeedbackEvent(id=f"p{partition}-{k}", tenant="acme", score=0.5)))
                     for k, partition in enumerate([0, 1, 2, 1])]
    ingest.flush()

    def waiting():
        ingest.load_store()
        return sorted(id_ for _, id_ in ingest.store.pending)

    assert waiting() == ["p0-0", "p1-1", "p1-3", "p2-2"]  # no metadata: all of it
    topics = {"t.i": {0, 1, 2}, "t.f": {0, 1, 2}}
    ingest.consumer._client = SimpleNamespace(cluster=SimpleNamespace(partitions_for_topic=topics.get))
    ingest.consumer.assigned = {TopicPartition("t.i", 1), TopicPartition("t.f", 1)}
    assert waiting() == ["p1-1", "p1-3"]
    ingest.consumer.assigned = {TopicPartition("t.i", 0), TopicPartition("t.i", 2), TopicPartition("t.f", 2)}
    assert waiting() == ["p2-2"], "the interactions topic's partitions say nothing of the feedback's"


def test_read_to_the_end_waits_a_while_for_an_open_transactions_records_then_leaves_them(ingest, monkeypatch):
    """read_committed stops at the last stable offset; the high-water mark counts an open transaction's records
    past it, which `--once` (and a drain on stop) waited for until the producer ended the transaction, up to
    its timeout (15 minutes at most)."""
    import ingest.consumer as consumer_module

    tp = TopicPartition("t.i", 0)

    class AtStableOffset(FakeConsumer):
        def end_offsets(self, partitions):
            return {p: 10 for p in partitions}  # the stable offset

        def position(self, partition):
            return 10

        def highwater(self, partition):
            return 12  # two records of a transaction still open

    now = [100.0]
    monkeypatch.setattr(consumer_module.time, "monotonic", lambda: now[0])
    ingest.consumer = AtStableOffset({tp})
    ingest.joined = True
    assert not ingest.drained()
    now[0] += consumer_module.OPEN_TRANSACTION_WAIT_S - 1
    assert not ingest.drained()
    now[0] += 1
    assert ingest.drained()
    ingest.consumer.highwater = lambda partition: 10  # and with nothing past the stable offset: at once
    ingest._short_of_highwater_since = None
    assert ingest.drained()
