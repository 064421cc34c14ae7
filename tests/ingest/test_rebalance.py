"""What one ingest process does when the group moves on without it: a commit the group refuses, and
partitions lost to an eviction. Nothing more is written or committed on the stale view; what was dropped
is read again (this process seeks back) or replayed by the partitions' next owner.

The consumer is a fake (FakeConsumer: it records commits and seeks, and refuses commits on demand); the
processing, the Parquet writes and the store view are the real ones. The real broker's rebalances are in
test_ingest_process.py (two processes in one group, one killed).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from kafka import TopicPartition
from kafka.errors import CommitFailedError

from ingest.batch import Processor, Record
from ingest.consumer import Ingest
from ingest.events import InteractionEvent, encode
from ingest.metrics import IngestMetrics
from ingest.pending import PendingStore
from storage.parquet import read_dataset

pytestmark = pytest.mark.unit


class FakeConsumer:
    """Stands in for KafkaConsumer: records commits and seeks; `refuse` makes the next commits fail as a
    group that has moved on does; `assigned` is what seek accepts."""

    def __init__(self, assigned):
        self.assigned = set(assigned)
        self.commits: list[dict] = []
        self.seeks: list[tuple[TopicPartition, int]] = []
        self.refuse = False

    def commit(self, offsets):
        if self.refuse:
            raise CommitFailedError("the group has already rebalanced")
        self.commits.append({tp: meta.offset for tp, meta in offsets.items()})

    def seek(self, tp, offset):
        if tp not in self.assigned:
            raise ValueError("Unassigned partition")
        self.seeks.append((tp, offset))


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


def test_a_refused_commit_stops_writing_and_seeks_back_to_what_it_dropped(ingest, data_dir):
    ingest.buffer = records(0, 0, 3)
    ingest._start_flush()  # batch 1 is being written
    ingest.buffer = records(0, 3, 2) + records(1, 10, 2)
    ingest.consumer.refuse = True
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
