"""The ingest loop: Kafka -> batch.py -> Parquet, offsets committed only after the write is durable.

    poll(500 ms) -> buffer -> (flush_rows reached, flush_seconds passed, or a poll came back empty) -> flush:
        1. Processor.process(buffer)            decode, score, deduplicate, join (batch.py)
        2. dead letters -> dead-letter topic     producer.flush() waits for the broker's ack (after 3)
        3. Parquet: interactions, feedback, trajectories, dead_letters, each one file per tenant named by
           the batch's offset ranges and its rows' keys, written tmp -> fsync -> link (storage.parquet)
        4. the store view learns of the rows; commit the offsets after the last record of each partition

Steps 2 and 3 run on one writer thread while the loop goes back to polling: Arrow, zstd and fsync release
the GIL, so the next batch is fetched while this one is written. At most one batch is being written;
before the next batch is processed (step 1), the write in flight is finished (steps 4 run on the loop's
thread), so every batch is decided against a store view that holds every earlier batch, exactly as if
the writes were serial, and the view never holds a row that is not durable. A failed write raises on the
loop's thread when it is finished, and nothing of it (or after it) is committed.

Exactly once under SIGKILL: a crash anywhere before 4 replays the batch from the last commit. A replay of
the same ranges lands on the same file names (a no-op); a replay cut differently is caught by the
per-dataset key indexes (pending.py), so no row is stored twice and a lost trajectory is derived again.
The dead-letter *topic* is at least once (a crash between 2 and 4 sends those again); dead_letters/ in
Parquet is exactly once.

Rebalances (several `clora ingest` processes in one group split the partitions): on revocation the write
in flight and the buffer are written and committed, then the in-memory view is dropped; after an
assignment it is rebuilt from the datasets (right after poll() returns, outside the listener, so
heartbeats go on meanwhile), so whatever the previous owner wrote is seen. The range assignor keeps
partition i of both topics on one process, which is what lets feedback find its interaction (both are
keyed by tenant).

Stopping: `stop` (an Event the process's signal handler sets) is checked after every poll; the buffer is
flushed and committed before the consumer closes. `drain` (set instead of `stop` with --drain-on-stop)
first reads every assigned partition to its end, for brokers that keep topics in memory only. `once` exits
when every assigned partition is read to its end. Memory: the buffer holds at most flush_rows records and
the writer at most one more batch; the store view is bounded as pending.py says.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.consumer.subscription_state import ConsumerRebalanceListener
from kafka.coordinator.assignors.range import RangePartitionAssignor
from kafka.errors import CommitFailedError, KafkaError
from kafka.producer.future import FutureRecordMetadata
from kafka.structs import OffsetAndMetadata

from ingest.batch import Output, Processor, Record
from ingest.events import utc_now
from ingest.metrics import IngestMetrics
from ingest.pending import PendingStore
from ingest.rows import Coords, DeadLetterRow, FeedbackRow, InteractionRow, TrajectoryRow, epoch_ms, to_table
from storage.parquet import write_dataset

logger = logging.getLogger(__name__)

POLL_MS = 500
WRITING_POLL_MS = 10  # while a write is in flight: poll briefly, so its commit follows it closely
EXPIRE_EVERY_S = 60.0  # how often pending feedback is checked for expiry (a pass over all of it)


def batch_file_id(ranges: dict[tuple[str, int], tuple[int, int]], keys: Iterable[tuple]) -> str:
    """The file id of one dataset's rows from one batch: `<ranges>-<digest of the row keys>`.

    The ranges part makes a replayed range recognisable (`<topic>.<partition>.<first>-<last>` for one
    range, a hash for several). The digest of the rows' keys makes the name unique to the content, so a
    replay that derives other rows from the same range (say, feedback that has meanwhile joined) never
    lands on an existing name and gets skipped; a replay that derives the same rows is a no-op.
    """
    if len(ranges) == 1:
        ((topic, partition), (first, last)), = ranges.items()
        prefix = f"{topic}.{partition}.{first:012d}-{last:012d}".lstrip("._-")
    else:
        prefix = ""
    if not prefix or len(prefix) > 150:
        text = "|".join(f"{t}:{p}:{a}-{b}" for (t, p), (a, b) in sorted(ranges.items()))
        prefix = "batch-" + hashlib.sha256(text.encode()).hexdigest()[:24]
    digest = hashlib.sha256("\x00".join(map(repr, keys)).encode()).hexdigest()[:12]
    return f"{prefix}-{digest}"


@dataclass
class Written:
    """What one batch's write put on disk: per dataset, the keys of its rows and the files holding them."""

    keys: dict[str, list[tuple]] = field(default_factory=dict)
    paths: dict[str, list[Path]] = field(default_factory=dict)


def write_files(root: str, out: Output) -> Written:
    """Writes one processed batch, one write_dataset per dataset (one file per tenant in each). Touches no
    store view, so it may run on another thread; raises if a write fails."""
    datasets = [
        ("interactions", InteractionRow, out.interactions, [(r.tenant, r.id) for r in out.interactions]),
        ("feedback", FeedbackRow, out.feedback, [(r.kafka_topic, r.kafka_partition, r.kafka_offset) for r in out.feedback]),
        ("trajectories", TrajectoryRow, out.trajectories, [(r.tenant, r.id) for r in out.trajectories]),
        ("dead_letters", DeadLetterRow, [d.row for d in out.dead_letters], [tuple(d.at) for d in out.dead_letters]),
    ]
    written = Written()
    for dataset, row_type, rows, keys in datasets:
        if rows:
            table = to_table(rows, row_type)
            written.paths[dataset] = write_dataset(root, dataset, table, file_id=batch_file_id(out.ranges, keys))
            written.keys[dataset] = keys
    return written


def record_written(store: PendingStore, out: Output, written: Written) -> None:
    """Tells the store view about rows that are now durable."""
    if "interactions" in written.keys:
        store.stored_interactions(out.interactions, written.paths["interactions"])
    if "feedback" in written.keys:
        store.stored_feedback(written.keys["feedback"])
    if "trajectories" in written.keys:
        store.stored_trajectories(written.keys["trajectories"])
    if "dead_letters" in written.keys:
        store.stored_dead_letters(written.keys["dead_letters"])


def write_output(root: str, store: PendingStore, out: Output) -> None:
    """Writes one processed batch and then tells the store view (what a flush does, on one thread). A
    failed write raises, and the caller then commits nothing."""
    record_written(store, out, write_files(root, out))


def now_ms() -> int:
    return epoch_ms(utc_now())


class _Rebalance(ConsumerRebalanceListener):
    """Routes kafka-python's rebalance callbacks to the Ingest that owns the consumer."""

    def __init__(self, ingest: Ingest) -> None:
        self.ingest = ingest

    def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        self.ingest.revoked(list(revoked))

    def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        self.ingest.assigned(list(assigned))


@dataclass
class _Write:
    """The batch on the writer thread."""

    future: Future
    out: Output
    store: PendingStore  # the view the batch was decided against, told of its rows once they are durable
    messages: int
    started: float  # monotonic, when its processing began


class Ingest:
    """One consumer in the ingest group. Build it, then `run(stop)`."""

    def __init__(
        self,
        *,
        root: str,
        bootstrap: str,
        interactions_topic: str,
        feedback_topic: str,
        dead_letter_topic: str,
        group_id: str,
        processor: Processor,
        flush_rows: int,
        flush_seconds: float,
        expiry_ms: int,
        session_timeout_ms: int,
        heartbeat_interval_ms: int,
        metrics: IngestMetrics,
    ) -> None:
        self.root = root
        self.bootstrap = bootstrap
        self.topics = [interactions_topic, feedback_topic]
        self.dead_letter_topic = dead_letter_topic
        self.group_id = group_id
        self.processor = processor
        self.flush_rows = flush_rows
        self.flush_seconds = flush_seconds
        self.expiry_ms = expiry_ms
        self.session_timeout_ms = session_timeout_ms
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.metrics = metrics
        self.store: PendingStore | None = None
        self.buffer: list[Record] = []
        self.buffer_since = 0.0
        self.consumer: KafkaConsumer | None = None
        self.producer: KafkaProducer | None = None
        self.writer: ThreadPoolExecutor | None = None
        self.writing: _Write | None = None
        self.assigned_at: float | None = None  # monotonic, first assignment; for the benchmark's rate
        self.last_flush_at: float | None = None
        self.expired_at = 0.0

    # --- the loop -------------------------------------------------------------------------------------

    def run(
        self,
        stop: threading.Event,
        *,
        once: bool = False,
        max_seconds: float | None = None,
        drain: threading.Event | None = None,
    ) -> None:
        """Consumes until `stop` is set (or `once` finds every partition read to its end, or `max_seconds`
        pass). Setting `drain` turns on `once` from then on: read what is there, commit it, exit."""
        deadline = None if max_seconds is None else time.monotonic() + max_seconds
        with contextlib.ExitStack() as resources:
            self.producer = KafkaProducer(
                bootstrap_servers=self.bootstrap,
                acks="all",
                linger_ms=5,
                max_request_size=self.processor.max_message_bytes + 65536,
            )
            resources.callback(self.producer.close)
            self.consumer = KafkaConsumer(
                bootstrap_servers=self.bootstrap,
                group_id=self.group_id,
                client_id=f"clora-ingest-{self.group_id}",
                enable_auto_commit=False,
                auto_offset_reset="earliest",
                session_timeout_ms=self.session_timeout_ms,
                heartbeat_interval_ms=self.heartbeat_interval_ms,
                partition_assignment_strategy=(RangePartitionAssignor,),  # co-partitioning: see pending.py
                max_poll_records=self.flush_rows,
                fetch_max_bytes=64 * 1024 * 1024,
                max_partition_fetch_bytes=8 * 1024 * 1024,
            )
            resources.callback(self.consumer.close, autocommit=False)
            # Closed first (callbacks run last-in first-out): a write still running when an error propagates
            # ends before the clients close; it is not committed, so it is replayed and deduplicated.
            self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ingest-writer")
            resources.callback(self.writer.shutdown, wait=True)
            self.consumer.subscribe(self.topics, listener=_Rebalance(self))
            logger.info("ingest: consuming %s as group %r", ", ".join(self.topics), self.group_id)
            self._loop(stop, once, deadline, drain or threading.Event())
            # Reached only on a clean stop: a failed write propagates without committing anything.
            self.flush()
            self.metrics.set_lag(self.lag())
            self.metrics.log()

    def _loop(self, stop: threading.Event, once: bool, deadline: float | None, drain: threading.Event) -> None:
        while not stop.is_set():
            once = once or drain.is_set()
            room = self.flush_rows - len(self.buffer)
            full_poll = self.writing is None
            polled = self.consumer.poll(timeout_ms=POLL_MS if full_poll else WRITING_POLL_MS, max_records=max(room, 1))
            if self.store is None and self.consumer.assignment():
                self.load_store()
            for tp, messages in polled.items():
                if not self.buffer:
                    self.buffer_since = time.monotonic()
                self.buffer.extend(Record(tp.topic, tp.partition, m.offset, m.value) for m in messages)
            # Commit a write as soon as it is done.
            if self.writing is not None and self.writing.future.done():
                self._finish_write()
            # Flush when the batch is full, old enough, or when a full poll came back empty (caught up: waiting
            # longer would only add latency).
            caught_up = full_poll and not polled
            if self.buffer and (
                caught_up or len(self.buffer) >= self.flush_rows or time.monotonic() - self.buffer_since >= self.flush_seconds
            ):
                self._start_flush()
            if self.metrics.due():
                self.metrics.set_lag(self.lag())
                self.metrics.log()
            if once and not polled and not self.buffer and self.writing is None and self.drained():
                logger.info("ingest: every assigned partition is read to its end (%s)", "drained" if drain.is_set() else "--once")
                return
            if deadline is not None and time.monotonic() >= deadline:
                logger.info("ingest: --max-seconds reached")
                return

    # --- flushing -------------------------------------------------------------------------------------

    def flush(self) -> None:
        """Writes the write in flight and the buffer durably, and commits their offsets. Raises (and commits
        nothing more) if a write fails."""
        self._start_flush()
        self._finish_write()

    def _start_flush(self) -> None:
        """Finishes the write in flight, processes the buffer, and hands its rows to the writer thread."""
        self._finish_write()
        if not self.buffer:
            return
        if self.store is None:  # records are only buffered while partitions are assigned
            raise RuntimeError(f"{len(self.buffer)} buffered records but no store view: a rebalance bug")
        started = time.monotonic()
        records, self.buffer = self.buffer, []
        out = self.processor.process(records, self.store, now_ms())
        self.writing = _Write(self.writer.submit(self._write, out), out, self.store, len(records), started)

    def _write(self, out: Output) -> Written:
        """On the writer thread: the dead letters are handed to the producer, Parquet is written while the
        broker acknowledges them, then the acknowledgements are awaited."""
        sent = self._send_dead_letters(out)
        written = write_files(self.root, out)
        self._await_dead_letters(sent)
        return written

    def _finish_write(self) -> None:
        """Waits for the write in flight; once it is durable, updates the store view and commits."""
        if self.writing is None:
            return
        write, self.writing = self.writing, None
        written = write.future.result()  # a failed write raises here, and nothing of it is committed
        record_written(write.store, write.out, written)
        self._commit(write.out.ranges)
        if time.monotonic() - self.expired_at >= EXPIRE_EVERY_S:
            self.expired_at = time.monotonic()
            if dropped := write.store.expire(now_ms()):
                logger.info("ingest: %d pending feedback expired without meeting its interaction", dropped)
        self.last_flush_at = time.monotonic()
        self.metrics.flushed(write.messages, write.out, self.last_flush_at - write.started, len(write.store.pending))

    def _send_dead_letters(self, out: Output) -> list[tuple[Coords, FutureRecordMetadata]]:
        """Hands the batch's dead letters to the producer (which sends them on its own thread)."""
        sent = []
        for rejected in out.dead_letters:
            row = rejected.row
            raw = rejected.raw if len(rejected.raw) <= self.processor.max_message_bytes else row.raw
            future = self.producer.send(
                self.dead_letter_topic,
                key=row.tenant.encode(),
                value=raw,
                headers=[
                    ("clora.reason", row.reason.encode()),
                    ("clora.detail", (row.detail or "")[:1000].encode()),
                    ("clora.source", f"{rejected.at.topic}:{rejected.at.partition}:{rejected.at.offset}".encode()),
                ],
            )
            sent.append((rejected.at, future))
        return sent

    def _await_dead_letters(self, sent: list[tuple[Coords, FutureRecordMetadata]]) -> None:
        """Waits until the broker has answered for every dead letter sent.

        A send that fails is logged, not raised: the dead letter is in Parquet either way, and a dead-letter
        topic that refuses messages must not stop ingest of the good ones.
        """
        if not sent:
            return
        self.producer.flush()
        failed = [(at, f.exception) for at, f in sent if f.failed()]
        if failed:
            at, e = failed[0]
            logger.error(
                "ingest: %d of %d dead letters could not be sent to %s (first: %s:%d:%d: %s); they are in dead_letters/",
                len(failed), len(sent), self.dead_letter_topic, at.topic, at.partition, at.offset, e,
            )

    def _commit(self, ranges: dict[tuple[str, int], tuple[int, int]]) -> None:
        offsets = {TopicPartition(t, p): OffsetAndMetadata(last + 1, "", -1) for (t, p), (_, last) in ranges.items()}
        try:
            self.consumer.commit(offsets)
        except CommitFailedError as e:
            # The group moved on (this process was too slow or a rebalance began). The rows are durable; the
            # next owner replays these offsets and the key indexes skip them.
            logger.warning("ingest: offset commit failed after a durable write (%s); the replay will be deduplicated", e)

    # --- rebalancing ----------------------------------------------------------------------------------

    def revoked(self, partitions: list[TopicPartition]) -> None:
        logger.info("ingest: revoked partitions %s", _names(partitions))
        try:
            self.flush()
        finally:
            self.store = None

    def assigned(self, partitions: list[TopicPartition]) -> None:
        # The store view is rebuilt after poll() returns, not here: a listener runs inside the consumer's
        # network loop, and a long load would hold up heartbeats until the group evicts this process.
        logger.info("ingest: assigned partitions %s", _names(partitions))
        try:
            self._finish_write()  # normally done on revocation already
        finally:
            self.store = None

    def load_store(self) -> None:
        self.store = PendingStore.load(self.root, expiry_ms=self.expiry_ms, now_ms=now_ms())
        self.metrics.set_pending(len(self.store.pending))
        self.assigned_at = self.assigned_at or time.monotonic()

    # --- progress -------------------------------------------------------------------------------------

    def lag(self) -> dict[tuple[str, int], int]:
        """Messages not yet consumed, per assigned partition (from the last fetch's high-water marks)."""
        lag = {}
        for tp in self.consumer.assignment():
            high = self.consumer.highwater(tp)
            if high is None:
                continue
            try:
                lag[(tp.topic, tp.partition)] = max(0, high - self.consumer.position(tp, timeout_ms=1000))
            except KafkaError as e:
                logger.debug("no position for %s yet: %s", tp, e)
        return lag

    def drained(self) -> bool:
        assignment = self.consumer.assignment()
        if not assignment or self.store is None:
            return False
        ends = self.consumer.end_offsets(list(assignment))
        return all(self.consumer.position(tp) >= ends[tp] for tp in assignment)


def _names(partitions: list[TopicPartition]) -> str:
    return ",".join(f"{tp.topic}:{tp.partition}" for tp in sorted(partitions)) or "none"
