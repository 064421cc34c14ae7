"""Fakes of kafka-python's consumer side for the ingest tests that drive `Ingest` without a broker: what the
loop reads of a ConsumerRecord, and a KafkaConsumer that records what it is asked to commit and seek. Each
test file adds the polling it needs by subclassing FakeConsumer; the real broker is in
test_ingest_process.py."""

from __future__ import annotations

from typing import NamedTuple

from kafka import TopicPartition
from kafka.errors import CommitFailedError, KafkaTimeoutError


class FakeConsumerRecord(NamedTuple):  # what the loop reads of a kafka-python ConsumerRecord
    topic: str
    partition: int
    offset: int
    value: bytes
    key: bytes | None


class FakeConsumer:
    """Stands in for KafkaConsumer: records commits and seeks; `refuse` makes the next commits fail as a
    group that has moved on does (with refuse = "timeout": as a broker that does not answer in time);
    `in_callback` makes them fail as kafka-python does inside a rebalance callback; `assigned` is what
    `assignment` answers and what seek accepts."""

    def __init__(self, assigned=()):
        self.assigned: set[TopicPartition] = set(assigned)
        self.commits: list[dict] = []
        self.seeks: list[tuple[TopicPartition, int]] = []
        self.refuse = False
        self.in_callback = False
        self.closed = False

    def commit(self, offsets):
        if self.in_callback:  # kafka-python 3 runs rebalance callbacks on its network thread, where this raises
            raise RuntimeError("Cannot block on net.run() from the IO thread itself.")
        if self.refuse == "timeout":
            raise KafkaTimeoutError("Timeout waiting for future")
        if self.refuse:
            raise CommitFailedError("the group has already rebalanced")
        self.commits.append({tp: meta.offset for tp, meta in offsets.items()})

    def seek(self, tp, offset):
        if tp not in self.assigned:
            raise ValueError("Unassigned partition")
        self.seeks.append((tp, offset))

    def assignment(self):
        return set(self.assigned)

    def highwater(self, tp):
        return None

    def close(self, autocommit=True):
        self.closed = True
