"""The ingest loop: Kafka -> batch.py -> Parquet, offsets committed only after the write is durable.

    poll(500 ms) -> buffer -> (flush_rows reached, flush_seconds passed, or a poll came back empty) -> flush:
        1. Processor.process(buffer)            decode, score, deduplicate, join (batch.py); a batch whose
                                                scorers ran out of time is cut, its partitions sought back
                                                to the first record left out, read again as the next batch
        2. dead letters -> dead-letter topic     producer.flush() waits for the broker's ack
        3. Parquet: interactions, feedback, trajectories, dead_letters, each one file per tenant named by
           the batch's offset ranges and its rows' keys, written tmp -> fsync -> link (storage.parquet)
        4. commit the offsets after the last record of each partition, once 2 and 3 are done

Pipelining: 2 and 3 run on writer threads (one task per dataset, one for the dead-letter topic) while
the loop polls and processes the next batch; Arrow encoding, zstd and fsync release the GIL, so the
write overlaps Python work on the loop's thread. At most one batch is being written: batch N+1 is
processed while N is written, then N is finished (waited for, committed) before N+1 starts writing, so
commits stay in offset order. The store view is told of N's rows when its write starts, and N+1 is
decided against that view (N's interactions are read from memory until they land; pending.py), which
gives exactly the decisions a serial loop would make. A failed write raises on the loop's thread when it
is finished: nothing of it, nor of N+1, is committed or written, and the process stops.

Exactly once under SIGKILL: a crash anywhere before 4 replays the batch from the last commit. A replay of
the same ranges lands on the same file names (a no-op); a replay cut differently is caught by the
per-dataset key indexes (pending.py), so no row is stored twice and a lost trajectory is derived again.
dead_letters/ in Parquet is exactly once, and the authoritative record. The dead-letter *topic* is best
effort: a replayed batch sends its dead letters again, those already in dead_letters/ included (2 and 3 run
side by side, so a crash may come after the Parquet file landed and before the broker acknowledged the
sends), so a message can reach it twice; and dead letters the topic has not acknowledged after
DEAD_LETTER_ATTEMPTS sends are given up (logged, counted in clora_ingest_dead_letters_not_delivered) and the
batch is committed all the same, so a message can also never reach it; nothing is sent to the topic for
DEAD_LETTER_PAUSE_S after that. An outage of the dead-letter topic neither stops ingest nor slows it.

Rebalances (several `clora ingest` processes in one group split the partitions): on revocation the write
in flight and the buffer are written and committed, then the in-memory view is dropped. Partitions *lost*
(this process was evicted, e.g. its session timed out, and another may own them already) are not written
to: the buffer is dropped uncommitted (the new owner replays it), the write in flight, which cannot be
stopped, is waited for but not committed, and the view is dropped. A commit the group refuses (it moved on)
likewise stops this process writing: the batch decided meanwhile and the buffer are dropped, their
partitions sought back to the first dropped offset (the next owner, or this process after rejoining,
replays them), and the view is dropped. The one write in flight at an eviction can land after the new owner
loaded its view, and its rows are then stored twice; nothing is lost. After an assignment the view is
rebuilt from the datasets (right after poll() returns, outside the listener, so heartbeats go on
meanwhile), so whatever the previous owner wrote is seen. Likewise the view's own occasional rebuild of its
interactions index (pending.py, `shrink_files`) runs in the loop after a commit, never in the listener,
which only finishes the write in flight. The range assignor keeps partition i of both topics on one
process, which is what lets feedback find its interaction (both are keyed by tenant).

Stopping: `stop` (an Event the process's signal handler sets) is checked after every poll; the write in
flight and the buffer are written and committed before the consumer closes (of a batch its scoring budget
cut, the part before the cut; the rest is read again at the next start). `drain` (set instead of `stop` with --drain-on-stop)
first reads every assigned partition to its end, for brokers that keep topics in memory only. `once` exits
when every assigned partition is read to its end. Memory: the buffer holds at most flush_rows records, plus
the batch being processed and the one being written; the store view is bounded as pending.py says
(pending feedback by `max_pending_per_tenant` per tenant and `max_pending` in all).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from operator import attrgetter, itemgetter
from pathlib import Path
from typing import NamedTuple

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.consumer.subscription_state import ConsumerRebalanceListener
from kafka.coordinator.assignors.range import RangePartitionAssignor
from kafka.errors import (
    CommitFailedError,
    CorruptRecordError,
    GroupAuthorizationFailedError,
    GroupMaxSizeReachedError,
    InconsistentGroupProtocolError,
    InvalidGroupIdError,
    InvalidSessionTimeoutError,
    KafkaError,
    KafkaTimeoutError,
    TopicAuthorizationFailedError,
    UnsupportedCodecError,
)
from kafka.producer.future import FutureRecordMetadata
from kafka.structs import OffsetAndMetadata

from ingest import record_batches
from ingest.batch import Output, Processor, Record, Rejected, offset_ranges
from ingest.broker import BrokerError
from ingest.events import utc_now
from ingest.metrics import IngestMetrics
from ingest.pending import MAX_PENDING, MAX_PENDING_PER_TENANT, OwnedPartitions, PendingStore
from ingest.rows import FEEDBACK_KEY, DeadLetterRow, FeedbackRow, InteractionRow, TrajectoryRow, epoch_ms, to_table
from storage.files import FileLock, atomic_write_bytes, clear_ready, mark_ready
from storage.layout import as_datadir
from storage.parquet import write_dataset

logger = logging.getLogger(__name__)

POLL_MS = 500
DEAD_LETTER_ATTEMPTS = 3  # sends of a dead letter the broker did not acknowledge, in all
DEAD_LETTER_BACKOFF_SECONDS = 0.5  # times the attempt number, between attempts
DEAD_LETTER_TIMEOUT_SECONDS = 30.0  # for the broker's answers to one attempt's dead letters, after flush()
# A send's whole life, retries included (kafka-python's default is 120 s): the attempts below, each bounded
# so, stay far inside max.poll.interval (a member silent that long leaves the group, and its batch replays).
DEAD_LETTER_DELIVERY_MS = 20_000
# How long the loop may go between polls (loading the store view after an assignment reads every stored key:
# minutes for a large store) before the group gives its partitions to another member. kafka-python's
# default is 5 minutes; past it, the load started again at the next assignment, and again.
MAX_POLL_INTERVAL_MS = 30 * 60_000
OPEN_TRANSACTION_WAIT_S = 10.0  # `--once` / draining: how long records past the stable offset are waited for
DEAD_LETTER_PAUSE_S = 60.0  # after giving up on the dead-letter topic, how long no dead letter is sent to it
DEAD_LETTER_BLOCK_MS = 10_000  # the longest a send may wait for the topic's metadata (kafka-python's max_block_ms)
WRITING_POLL_MS = 10  # while a write is in flight: poll briefly, so its commit follows it closely
# A batch is flushed at this many bytes of message values too: at flush_rows alone, 5,000 messages of up to
# ingest.max_message_bytes (1 MB) could hold 5 GB in memory, and its decoded rows and Arrow tables several times more.
FLUSH_BYTES = 64 << 20
# In the state dir: per topic, the broker's id for it and since when ingest reads that incarnation
# (`_topics_since`).
TOPICS_FILE = "ingest-topics.json"
WRITER_THREADS = 3  # a batch's files at once: the small datasets beside its trajectories, then its interactions (BatchWrite)
EXPIRE_EVERY_S = 60.0  # how often pending feedback is checked for expiry (a pass over all of it)
FOLLOW_EVERY_S = 1.0  # how often `follow` (the config read again) is called: sooner than serving's 5 s, so a
# tenant added to the config is known here before serving accepts its requests


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


# ---------------------------------------------------------------------------------------------------------
# Writing one batch


class DatasetRows(NamedTuple):
    """One dataset's rows from one batch, with the key each row is deduplicated on (the store view's index),
    and what the file id digests when that is not the keys (dead letters: see batch_datasets)."""

    dataset: str
    row_type: type
    rows: list
    keys: list[tuple]
    name_keys: list[tuple] | None = None


# The key of a row, read by C code rather than by a Python expression per row.
_TENANT_ID = attrgetter("tenant", "id")


def batch_datasets(out: Output) -> list[DatasetRows]:
    """The datasets a processed batch has rows for.

    A dead letter's key is its offset, (topic, partition, offset), and an offset names one message only
    while its topic lives: a topic made again (the embedded broker's, at each start) numbers its offsets
    from 0 again. Its file id therefore digests each message's bytes too, so that another message rejected
    at a stored offset (the store view tells it from the old one: pending.py, `topics_since`) gets a file
    of its own, where the stored file's name would be taken as written already (storage.parquet), while a
    replay of the same messages still lands on the same name. Rows of the other datasets are keyed by what
    they hold ((tenant, id), feedback's content): the same key is the same event, whichever topic carried it."""
    datasets = [  # trajectories before interactions: see BatchWrite
        DatasetRows("trajectories", TrajectoryRow, out.trajectories, list(map(_TENANT_ID, out.trajectories))),
        DatasetRows("interactions", InteractionRow, out.interactions, list(map(_TENANT_ID, out.interactions))),
        DatasetRows("feedback", FeedbackRow, out.feedback, list(map(FEEDBACK_KEY, out.feedback))),
        DatasetRows("dead_letters", DeadLetterRow, [d.row for d in out.dead_letters], [tuple(d.at) for d in out.dead_letters],
                    [(*d.at, hashlib.blake2b(d.raw, digest_size=8).hexdigest()) for d in out.dead_letters]),
    ]
    return [d for d in datasets if d.rows]


def write_rows(root: str, part: DatasetRows, ranges: dict[tuple[str, int], tuple[int, int]]) -> list[Path]:
    """Writes one dataset's rows of a batch (one file per tenant); returns the paths holding them. Touches
    no store view, so it runs on any thread.

    The rows are grouped by tenant (a stable sort: each tenant's rows keep their order) before the table
    is built, so write_dataset splits it into files by slicing rather than by sorting the Arrow table."""
    by_tenant = sorted(part.rows, key=itemgetter(part.row_type._fields.index("tenant")))
    file_id = batch_file_id(ranges, part.keys if part.name_keys is None else part.name_keys)
    return write_dataset(root, part.dataset, to_table(by_tenant, part.row_type), file_id=file_id)


def _write_after(first: Future | None, root: str, part: DatasetRows,
                 ranges: dict[tuple[str, int], tuple[int, int]]) -> list[Path]:
    """write_rows once `first` (a write submitted before this one) is durable; nothing if it failed."""
    if first is not None:
        first.result()
    return write_rows(root, part, ranges)


def _tell_store(store: PendingStore, part: DatasetRows) -> None:
    """The store view learns of one dataset's rows (interactions: see writing_interactions)."""
    if part.dataset == "interactions":
        store.writing_interactions(part.rows, part.keys)
    elif part.dataset == "feedback":
        store.stored_feedback(part.keys)
    elif part.dataset == "trajectories":
        store.stored_trajectories(part.keys)
    else:
        store.stored_dead_letters(part.keys, [row.reason for row in part.rows])


def write_output(root: str, store: PendingStore, out: Output) -> None:
    """Writes one processed batch on this thread, then tells the store view (and lets it shrink its file
    list, as the loop does after a commit). A failed write raises (the view learns nothing), and the caller
    then commits nothing."""
    parts = batch_datasets(out)
    paths = {part.dataset: write_rows(root, part, out.ranges) for part in parts}
    for part in parts:
        _tell_store(store, part)
    store.interactions_written(paths.get("interactions", []))
    store.shrink_files()


class BatchWrite:
    """One processed batch being written on an executor, one task per dataset, so that the datasets'
    files are encoded, compressed and fsynced concurrently (all of that releases the GIL).

    The store view is told of the rows when the write starts, so the next batch can be decided against
    it meanwhile, and where the interactions landed once `wait` returns (pending.py).

    One order holds: the interactions file is written only once the trajectories file is durable. A stored
    interaction counts as decided when it is read again (a replay after a crash, the batch not committed):
    a trajectory on disk is its score, none means it waits for feedback. Left on disk without the trajectory
    this batch decided for it (a crash between the two files), its replay could no longer be scored as it
    was: its inline reward is not in the interactions file, feedback read before it joins as if it were the
    first, and feedback that waited past the expiry is gone. The other files may land in any order.
    """

    def __init__(self, root: str, store: PendingStore, out: Output, executor: Executor) -> None:
        self.out = out
        self.store = store
        parts = batch_datasets(out)  # trajectories first: submitted before the interactions task waits on them
        self.futures: dict[str, Future] = {}
        for part in parts:
            after = self.futures.get("trajectories") if part.dataset == "interactions" else None
            self.futures[part.dataset] = executor.submit(_write_after, after, root, part, out.ranges)
        for part in parts:
            _tell_store(store, part)

    def done(self) -> bool:
        return all(f.done() for f in self.futures.values())

    def wait(self) -> None:
        """Returns once every file is durable; raises the first failure."""
        paths = {dataset: future.result() for dataset, future in self.futures.items()}
        self.store.interactions_written(paths.get("interactions", []))


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

    def on_partitions_lost(self, lost: Iterable[TopicPartition]) -> None:
        self.ingest.lost(list(lost))


@dataclass
class _Write:
    """The batch being written: its files, and its dead letters on their way to the dead-letter topic."""

    batch: BatchWrite
    dead_letters: Future
    messages: int
    started: float  # monotonic, when its processing began

    def done(self) -> bool:
        return self.batch.done() and self.dead_letters.done()


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
        max_pending_per_tenant: int = MAX_PENDING_PER_TENANT,
        max_pending: int | None = MAX_PENDING,
        max_batch_bytes: int = record_batches.DEFAULT_MAX_BATCH_BYTES,
        name: str = "ingest",
        client_options: dict | None = None,
        follow: Callable[[], None] | None = None,
    ) -> None:
        """`follow`: called from the loop every FOLLOW_EVERY_S, between batches (ingest.process reads the
        config again there and hands its tenants to the processor). `max_batch_bytes`: the most one record
        batch may decompress to (ingest.record_batches: past it, or unreadable, a batch is a dead letter)."""
        self.root = root
        self.follow = follow
        self.followed_at = time.monotonic()
        # kafka-python's connection options (KafkaConfig.client_options: TLS, SASL), for both clients.
        self.client_options = {"bootstrap_servers": bootstrap, **(client_options or {})}
        self.name = name  # its ready mark's name: ingest, or ingest-K for one of several under `clora up`
        self.bootstrap = bootstrap
        self.topics = [interactions_topic, feedback_topic]
        self.dead_letter_topic = dead_letter_topic
        self.group_id = group_id
        self.processor = processor
        self.flush_rows = flush_rows
        self.flush_seconds = flush_seconds
        self.max_batch_bytes = max_batch_bytes
        self.expiry_ms = expiry_ms
        self.max_pending_per_tenant = max_pending_per_tenant
        self.max_pending = max_pending
        self.session_timeout_ms = session_timeout_ms
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.metrics = metrics
        self.store: PendingStore | None = None
        self.buffer: list[Record] = []
        self.buffer_bytes = 0  # of the buffered messages' values
        self.buffer_since = 0.0
        self.consumer: KafkaConsumer | None = None
        self.producer: KafkaProducer | None = None
        self.writer: ThreadPoolExecutor | None = None
        self.writing: _Write | None = None
        # For the benchmark: monotonic and process CPU time at the first assignment and at the last commit.
        self.assigned_at: float | None = None
        self.assigned_cpu: float | None = None
        self.last_flush_at: float | None = None
        self.last_flush_cpu: float | None = None
        self.expired_at = 0.0
        # Whether the group's last rebalance has finished and given this process its assignment (which may be
        # empty: more processes than partitions). False from a revocation or loss until the next assignment.
        self.joined = False
        # topic -> the id this process last read it under: a topic made again since (a broker that keeps its
        # topics in memory and started again; a topic deleted and made anew) must be read from its start
        self._read_ids: dict[str, str] = {}
        self._short_of_highwater_since: float | None = None  # drained(): at the stable offsets since then
        self._dead_letter_pause_until = 0.0  # monotonic: until then the dead-letter topic is not sent to
        self._mismatch_logged: tuple[int, int] | None = None  # the topics' partition counts last said to differ

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
        record_batches.install(self.max_batch_bytes)
        with contextlib.ExitStack() as resources:
            with _bootstrap_errors(self.bootstrap):
                self.producer = KafkaProducer(
                    **self.client_options,
                    acks="all",
                    linger_ms=5,
                    max_block_ms=DEAD_LETTER_BLOCK_MS,
                    request_timeout_ms=DEAD_LETTER_DELIVERY_MS - 5_000,
                    delivery_timeout_ms=DEAD_LETTER_DELIVERY_MS,
                    max_request_size=self.processor.max_message_bytes + 65536,
                )
            resources.callback(self.producer.close)
            with _bootstrap_errors(self.bootstrap):
                self.consumer = KafkaConsumer(
                    **self.client_options,
                    group_id=self.group_id,
                    client_id=f"clora-ingest-{self.group_id}",
                    enable_auto_commit=False,
                    auto_offset_reset="earliest",
                    # Events of a producer's aborted transaction are never stored (read_uncommitted, Kafka's
                    # default, took them, and, the first copy winning, over the committed retry).
                    isolation_level="read_committed",
                    session_timeout_ms=self.session_timeout_ms,
                    heartbeat_interval_ms=self.heartbeat_interval_ms,
                    max_poll_interval_ms=MAX_POLL_INTERVAL_MS,
                    partition_assignment_strategy=(RangePartitionAssignor,),  # co-partitioning: see pending.py
                    max_poll_records=self.flush_rows,
                    fetch_max_bytes=64 * 1024 * 1024,
                    max_partition_fetch_bytes=8 * 1024 * 1024,
                )
            resources.callback(self.consumer.close, autocommit=False)
            # Closed first (callbacks run last-in first-out): a write still running when an error propagates
            # ends before the clients close; it is not committed, so it is replayed and deduplicated.
            self.writer = ThreadPoolExecutor(max_workers=WRITER_THREADS, thread_name_prefix="ingest-writer")
            resources.callback(self.writer.shutdown, wait=True)
            self.consumer.subscribe(self.topics, listener=_Rebalance(self))
            logger.info("ingest: consuming %s as group %r", ", ".join(self.topics), self.group_id)
            with _group_errors(self.group_id, self.session_timeout_ms):
                self._loop(stop, once, deadline, drain or threading.Event())
                # Reached only on a clean stop: a failed write propagates without committing anything.
                self.flush()
            self.metrics.set_lag(self.lag())
            self.metrics.log()
        clear_ready(as_datadir(self.root).state, self.name)  # a clean stop: a mark left behind says otherwise

    def _loop(self, stop: threading.Event, once: bool, deadline: float | None, drain: threading.Event) -> None:
        while not stop.is_set():
            once = once or drain.is_set()
            room = self.flush_rows - len(self.buffer)
            full_poll = self.writing is None
            polled = self.consumer.poll(timeout_ms=POLL_MS if full_poll else WRITING_POLL_MS, max_records=max(room, 1))
            if self.store is None and self.joined:
                if self.consumer.assignment():
                    self.load_store()
                    self.metrics.loop_alive()  # after a long load, not at the next log line
                    if remade := self._reposition_remade_topics():  # what this poll read there: read again
                        polled = {tp: records for tp, records in polled.items() if tp.topic not in remade}
                elif self.assigned_at is None:
                    self._mark_ready()  # in the group with no partition (more processes than partitions)
            for messages in polled.values():
                if not self.buffer:
                    self.buffer_since, self.buffer_bytes = time.monotonic(), 0
                # kafka-python's ConsumerRecords as they come: they have a Record's fields (batch.Record).
                self.buffer.extend(messages)
                self.buffer_bytes += sum(len(m.value or b"") for m in messages)
            # Commit a write as soon as it is done.
            if self.writing is not None and self.writing.done() and not self._finish_write(shrink=True):
                self._drop_uncommitted({}, "the group refused a commit")
            # Flush when the batch is full, old enough, or when a full poll came back empty (caught up: waiting
            # longer would only add latency).
            caught_up = full_poll and not polled
            if self.buffer and (
                caught_up or len(self.buffer) >= self.flush_rows or self.buffer_bytes >= FLUSH_BYTES
                or time.monotonic() - self.buffer_since >= self.flush_seconds
            ):
                self._start_flush(shrink=True)
            if self.metrics.due():
                self.metrics.set_lag(self.lag())
                self.metrics.log()
            if self.follow is not None and time.monotonic() - self.followed_at >= FOLLOW_EVERY_S:
                self.followed_at = time.monotonic()
                self.follow()
            if once and not polled and not self.buffer and self.writing is None and self.drained():
                logger.info("ingest: every assigned partition is read to its end (%s)", "drained" if drain.is_set() else "--once")
                return
            if deadline is not None and time.monotonic() >= deadline:
                logger.info("ingest: --max-seconds reached")
                return

    # --- flushing -------------------------------------------------------------------------------------

    def flush(self, *, commit: bool = True) -> None:
        """Finishes the write in flight, writes the buffer, and commits both (unless not `commit`: see
        `revoked`); returns once all is durable. Raises (and commits nothing more) if a write fails."""
        self._start_flush(commit=commit)
        self._finish_write(commit=commit)

    def _start_flush(self, *, shrink: bool = False, commit: bool = True) -> None:
        """Processes the buffer while the previous batch is still being written, then finishes that write
        (commits it) and starts writing this batch. `shrink`, `commit`: as for `_finish_write`."""
        if not self.buffer:
            self._finish_write(shrink=shrink, commit=commit)
            return
        if self.store is None:  # records are only buffered while partitions are assigned
            raise RuntimeError(f"{len(self.buffer)} buffered records but no store view: a rebalance bug")
        started = time.monotonic()
        records, self.buffer = self.buffer, []
        out = self.processor.process(records, self.store, now_ms())
        if out.cut is not None:  # its scorers used the batch's time budget: the rest is read again
            rest = records[out.cut:]
            logger.warning("ingest: scoring took the batch's %gs (ingest.max_batch_scoring_seconds); writing its first "
                           "%d records, reading the other %d again (a slow scorer: ingest falls behind)",
                           self.processor.scoring_budget_s, out.cut, len(rest))
            self._seek_back(offset_ranges(rest))
        # If the previous write failed, this raises and `out` is never written.
        if not self._finish_write(shrink=shrink, commit=commit):
            self._drop_uncommitted(out.ranges, "the group refused the previous batch's commit")
            return
        self.writing = _Write(
            BatchWrite(self.root, self.store, out, self.writer),
            self.writer.submit(self._dead_letters, out),
            len(records) if out.cut is None else out.cut,  # the rest is read, and counted, again
            started,
        )

    def _finish_write(self, *, shrink: bool = False, commit: bool = True) -> bool:
        """Waits for the write in flight; once it is durable, commits its offsets (unless not `commit`: the
        rebalance callbacks', which cannot). Returns False if the group refused the commit (this process must
        then stop writing: see `_drop_uncommitted`).

        `shrink` (the loop's calls only): then lets the store view shrink its interactions file list, which
        may rebuild its index from every stored id (pending.py). Not in a rebalance callback, where slow
        work holds up the group's rebalance, nor in a final flush: both drop the view right after."""
        if self.writing is None:
            return True
        write, self.writing = self.writing, None
        write.batch.wait()  # a failed write raises here, and nothing of it is committed
        self.metrics.dead_letters_not_delivered(write.dead_letters.result())
        if commit and not self._commit(write.batch.out.ranges):
            return False
        store = write.batch.store
        if time.monotonic() - self.expired_at >= EXPIRE_EVERY_S:
            self.expired_at = time.monotonic()
            if dropped := store.expire(now_ms()):
                logger.info("ingest: %d pending feedback expired without meeting its interaction", dropped)
                self.metrics.pending_dropped("expired", dropped)
        self.last_flush_at, self.last_flush_cpu = time.monotonic(), time.process_time()
        self.metrics.flushed(write.messages, write.batch.out, self.last_flush_at - write.started, len(store.pending))
        if shrink:
            store.shrink_files()
        return True

    def _dead_letters(self, out: Output) -> int:
        """On a writer thread: sends the batch's dead letters and waits for the broker's answers. A send the
        broker did not acknowledge is sent again (up to DEAD_LETTER_ATTEMPTS times in all) before giving up.
        Returns how many were given up on (the loop counts them: clora_ingest_dead_letters_not_delivered).

        Giving up is logged, not raised: the dead letter is in Parquet either way, and a dead-letter topic
        that refuses messages must not stop ingest of the good ones. Nor slow it: once this gives up, the
        next DEAD_LETTER_PAUSE_S seconds' dead letters are not sent (given up at once, counted): each batch
        with a dead letter waited out the topic's metadata (10 s) or every attempt (~1 min) before its commit.
        """
        everything = out.dead_letters + out.replayed_dead_letters
        if everything and time.monotonic() < self._dead_letter_pause_until:
            return len(everything)
        pending = list(everything)
        for attempt in range(1, DEAD_LETTER_ATTEMPTS + 1):
            if not pending:
                return 0
            try:
                sent = [(rejected, self._send_dead_letter(rejected)) for rejected in pending]
            except (KafkaError, ValueError) as e:
                # send() raises (rather than failing its future) when the topic's metadata does not come
                # within DEAD_LETTER_BLOCK_MS: the topic is missing or the cluster unreachable. The others
                # would wait as long each: give up on this batch's dead letters at once.
                failed = [(rejected, e) for rejected in pending]
                break
            try:
                self.producer.flush(timeout=DEAD_LETTER_DELIVERY_MS / 1000)
            except KafkaError as e:  # KafkaTimeoutError: some sends are not answered yet; the futures below say which
                logger.debug("ingest: flushing %d dead letters to %s: %s", len(sent), self.dead_letter_topic, e)
            failed = []
            # One deadline for the attempt's answers, not one per dead letter: after a flush that timed out,
            # a producer that answers nothing would otherwise hold this thread that long for each of them.
            deadline = time.monotonic() + DEAD_LETTER_TIMEOUT_SECONDS
            for rejected, future in sent:
                # Each send's own answer, not flush()'s word: a send can still be on its way to the
                # producer's buffer when flush() looks, and "not done" must not pass for "acknowledged".
                try:
                    future.get(timeout=max(0.0, deadline - time.monotonic()))
                except KafkaError as e:
                    failed.append((rejected, e))
            pending = [rejected for rejected, _ in failed]
            if failed and attempt < DEAD_LETTER_ATTEMPTS:
                logger.warning("ingest: %d dead letters not acknowledged by %s (%s); sending them again",
                               len(failed), self.dead_letter_topic, failed[0][1])
                time.sleep(DEAD_LETTER_BACKOFF_SECONDS * attempt)
        if not pending:
            return 0
        at, e = failed[0][0].at, failed[0][1]
        self._dead_letter_pause_until = time.monotonic() + DEAD_LETTER_PAUSE_S
        logger.error(
            "ingest: %d of %d dead letters could not be sent to %s (first: %s:%d:%d: %s); they are in dead_letters/, "
            "as are those of the next %.0f s, which are not sent (counted as not delivered)",
            len(failed), len(everything), self.dead_letter_topic, at.topic, at.partition, at.offset, e,
            DEAD_LETTER_PAUSE_S,
        )
        return len(failed)

    def _send_dead_letter(self, rejected: Rejected) -> FutureRecordMetadata:
        """Hands one dead letter to the producer (which sends it on its own thread)."""
        row = rejected.row
        raw = rejected.raw if len(rejected.raw) <= self.processor.max_message_bytes else row.raw
        return self.producer.send(
            self.dead_letter_topic,
            key=row.tenant.encode(),
            value=raw,
            headers=[
                ("clora.reason", row.reason.encode()),
                ("clora.detail", (row.detail or "")[:1000].encode()),
                ("clora.source", f"{rejected.at.topic}:{rejected.at.partition}:{rejected.at.offset}".encode()),
            ],
        )

    def _commit(self, ranges: dict[tuple[str, int], tuple[int, int]]) -> bool:
        offsets = {TopicPartition(t, p): OffsetAndMetadata(last + 1, "", -1) for (t, p), (_, last) in ranges.items()}
        try:
            self.consumer.commit(offsets)
        except CommitFailedError as e:
            # The group moved on (this process was too slow or a rebalance began). The rows are durable; the
            # next owner replays these offsets and the key indexes skip them.
            logger.warning("ingest: offset commit failed after a durable write (%s); the replay will be deduplicated", e)
            return False
        except KafkaTimeoutError as e:  # the broker did not answer within the request timeout: as above
            logger.warning("ingest: offset commit timed out after a durable write (%s); the replay will be "
                           "deduplicated", e)
            return False
        return True

    def _drop_uncommitted(self, ranges: dict[tuple[str, int], tuple[int, int]], why: str,
                          level: int = logging.WARNING) -> None:
        """Stops writing on a view the group has moved past: drops the batch of `ranges` (processed, not
        written) and the buffer, seeks their partitions back to the first dropped offset (a partition still
        assigned then reads them again; one that moved is replayed by its new owner from the last commit),
        and drops the view, which is rebuilt from the datasets after the next poll."""
        first = dict(ranges)
        for rec in self.buffer:
            tp = (rec.topic, rec.partition)
            if tp not in first or rec.offset < first[tp][0]:
                first[tp] = (rec.offset, rec.offset)
        logger.log(level, "ingest: %s; dropping %d uncommitted records of %s for replay", why,
                   sum(b - a + 1 for a, b in ranges.values()) + len(self.buffer), _names([TopicPartition(*tp) for tp in first]))
        self.buffer = []
        self._seek_back(first)
        self.store = None

    def _seek_back(self, ranges: dict[tuple[str, int], tuple[int, int]]) -> None:
        """Moves each partition of `ranges` back to its first offset there, to read it again from there."""
        for (topic, partition), (offset, _) in ranges.items():
            try:
                self.consumer.seek(TopicPartition(topic, partition), offset)
            except (KafkaError, ValueError) as e:  # no longer assigned: its new owner replays it
                logger.debug("ingest: no seek back on %s:%d (%s)", topic, partition, e)

    # --- rebalancing ----------------------------------------------------------------------------------

    def revoked(self, partitions: list[TopicPartition]) -> None:
        """Before the group hands the partitions on: finishes the write in flight durably, so their next
        owner (which loads its view after every member's revocation) finds its keys, and drops the buffer,
        seeking its partitions back to its first offsets: a partition that moves is read again by its next
        owner from the last commit, and one this process keeps (kafka-python keeps the position of a
        partition in both assignments) from where the buffer began. Processing the buffer here would run the
        scorers on kafka-python's network thread, where their time limit does not hold (scorers.py), while
        the group waits.

        Not committed: kafka-python (3.x) runs rebalance callbacks on its network thread, where a blocking
        commit raises (it cannot wait for the loop it is running on), and that error would end the process.
        The next owner, this process included, replays the uncommitted offsets and its key indexes skip
        what is stored: one batch read twice per rebalance, nothing stored twice."""
        logger.info("ingest: revoked partitions %s", _names(partitions))
        self.joined = False
        try:
            if self.buffer:
                self._drop_uncommitted({}, "partitions revoked", level=logging.INFO)
            self._finish_write(commit=False)
        finally:
            self.store = None

    def lost(self, partitions: list[TopicPartition]) -> None:
        """This process was evicted from the group: its partitions may be another's already. Nothing more is
        written or committed for them (the buffer is dropped; the next owner replays it from the last
        commit); the write in flight cannot be stopped, so it is waited for, uncommitted."""
        logger.warning("ingest: lost partitions %s (evicted from the group); %d buffered records dropped for replay",
                       _names(partitions), len(self.buffer))
        self.joined = False
        self.buffer = []
        write, self.writing = self.writing, None
        try:
            if write is not None:
                write.batch.wait()
                self.metrics.dead_letters_not_delivered(write.dead_letters.result())
        finally:
            self.store = None

    def assigned(self, partitions: list[TopicPartition]) -> None:
        # The store view is rebuilt after poll() returns, not here: a listener runs inside the consumer's
        # network loop, and a long load would hold up heartbeats until the group evicts this process.
        logger.info("ingest: assigned partitions %s", _names(partitions))
        if not partitions:
            logger.warning("ingest: no partition assigned: the group %r has more members than the topics have "
                           "partitions; this process waits idle until a rebalance gives it one", self.group_id)
        self.joined = True
        try:
            self._finish_write(commit=False)  # normally done on revocation already; not committed: see revoked
        finally:
            self.store = None

    def load_store(self) -> None:
        self.store = PendingStore.load(
            self.root, expiry_ms=self.expiry_ms, now_ms=now_ms(), max_pending_per_tenant=self.max_pending_per_tenant,
            max_pending=self.max_pending, function_scored=self.processor.functions,
            topics_since=self._topics_since(), owned=self._owned_feedback(),
        )
        self.metrics.set_pending(len(self.store.pending))
        self._check_partition_counts()
        if self.assigned_at is None:
            self._mark_ready()

    def _check_partition_counts(self) -> None:
        """Logs an error (once per change) when the two topics' partition counts differ: the group splits
        each topic on its own, so with several ingest processes a tenant's feedback then reaches another
        process than its interactions, and waits there until it expires, never joined."""
        cluster = self._metadata()
        counts = tuple(len(cluster.partitions_for_topic(t) or ()) if cluster is not None else 0 for t in self.topics)
        if 0 in counts or counts[0] == counts[1] or counts == self._mismatch_logged:
            return
        self._mismatch_logged = counts
        logger.error("ingest: %s has %d partitions but %s has %d: with more than one ingest process, feedback "
                     "reaches another process than its interaction and never joins it; give both topics the same "
                     "partition count", self.topics[0], counts[0], self.topics[1], counts[1])

    def _reposition_remade_topics(self) -> set[str]:
        """The topics made again (a new id) since this process last read them; their assigned partitions are
        moved to the group's committed offset on the new topic, else its beginning. kafka-python keeps a
        partition's position across a rebalance that assigns it again, so it went on at the old topic's
        offset: a broker started again with its topics made anew lost the first messages sent to them."""
        ids = self._topic_ids()
        remade = {topic for topic, topic_id in ids.items() if self._read_ids.get(topic, topic_id) != topic_id}
        self._read_ids.update(ids)
        for tp in [tp for tp in self.consumer.assignment() if tp.topic in remade]:
            committed = self.consumer.committed(tp)
            if committed is None:
                self.consumer.seek_to_beginning(tp)
            else:
                self.consumer.seek(tp, committed)
            logger.info("ingest: %s:%d is read from %s: its topic was made again", tp.topic, tp.partition,
                        "the beginning" if committed is None else f"offset {committed}, committed on the new topic")
        return remade

    def _topic_ids(self) -> dict[str, str]:
        """topic -> its id, for the topics whose id the client's metadata holds (the broker gives one)."""
        cluster = self._metadata()
        if cluster is None or not hasattr(cluster, "topic_id"):
            return {}
        ids = {topic: cluster.topic_id(topic) for topic in self.topics}
        return {topic: str(topic_id) for topic, topic_id in ids.items() if topic_id is not None}

    def _metadata(self):
        """kafka-python's cluster metadata as the client holds it (a private attribute; None without a client):
        read without asking the broker."""
        return getattr(getattr(self.consumer, "_client", None), "cluster", None)

    def _owned_feedback(self) -> OwnedPartitions | None:
        """The feedback topic's partitions assigned to this process, whose pending feedback it loads; None
        (all of it) while the topic's partitions are not in the client's metadata. The metadata is read as
        it is: KafkaConsumer.partitions_for_topic would ask the broker for it and wait without a limit."""
        topic = self.topics[1]
        cluster = self._metadata()
        count = None if cluster is None else cluster.partitions_for_topic(topic)
        if not count:
            return None
        mine = frozenset(tp.partition for tp in self.consumer.assignment() if tp.topic == topic)
        return OwnedPartitions(mine, max(count) + 1)

    def _topics_since(self) -> dict[str, int]:
        """topic -> since when (epoch ms) ingest has read the topic as it is now, for the topics whose id the
        broker gives (TOPICS_FILE). A topic deleted and made again, as the embedded broker's are at each
        start (it keeps them in memory), has a new id and numbers its offsets from 0 again: the dead letters
        stored at the old topic's offsets are then other messages than the new ones there."""
        ids = self._topic_ids()
        if not ids:
            return {}
        state = as_datadir(self.root).state
        state.mkdir(parents=True, exist_ok=True)
        path = state / TOPICS_FILE
        with FileLock(state / (TOPICS_FILE + ".lock")):  # several ingest processes start together
            try:
                known = json.loads(path.read_text())
            except FileNotFoundError:
                known = {}
            except (OSError, ValueError) as e:  # damaged: written again, as if never seen (below)
                logger.warning("ingest: %s unreadable (%s); written again", path, e)
                known = {}
            if not isinstance(known, dict):
                known = {}
            changed = False
            for topic, topic_id in ids.items():
                entry = known.get(topic)
                was = entry.get("id") if isinstance(entry, dict) else None
                if was != topic_id or not isinstance(entry.get("since_ms"), int):
                    if topic in known:
                        logger.info("ingest: topic %s was made again (id %s, was %s): its offsets start over",
                                    topic, topic_id, was)
                    # Never seen (or the file lost or damaged): what is stored may come from another incarnation,
                    # whose dead letters, taken for this one's, would make its messages at their offsets look
                    # like replays and lose them. From now: at worst a dead letter of this one stored twice (a
                    # crash between its write and its commit, with the file lost meanwhile).
                    known[topic] = {"id": topic_id, "since_ms": now_ms()}
                    changed = True
            if changed:
                atomic_write_bytes(path, json.dumps(known, indent=1).encode())
        return {topic: int(known[topic]["since_ms"]) for topic in ids}

    def _mark_ready(self) -> None:
        self.assigned_at, self.assigned_cpu = time.monotonic(), time.process_time()
        # In the group (its store view loaded, where it has partitions): `clora up` goes on.
        mark_ready(as_datadir(self.root).state, self.name)

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
        """Every assigned partition is read to its end; true for an empty assignment once the group has
        given it (a process with no partition has nothing to read), false while a rebalance is under way."""
        assignment = self.consumer.assignment()
        if not self.joined:
            return False
        if not assignment:
            return True
        if self.store is None:
            return False
        ends = self.consumer.end_offsets(list(assignment))  # read_committed: the last stable offsets
        positions = {tp: self.consumer.position(tp) for tp in assignment}
        if not all(positions[tp] >= ends[tp] for tp in assignment):
            self._short_of_highwater_since = None
            return False
        # And the high-water mark the last fetch saw: the embedded broker's end offset can lag the records it
        # holds (a partition written in several producer batches), which a position sought back lies behind.
        # A read_committed consumer stops before an open transaction's records, which the high-water mark
        # counts: at the stable offsets for OPEN_TRANSACTION_WAIT_S, the rest is left to the next run.
        if all(positions[tp] >= (self.consumer.highwater(tp) or 0) for tp in assignment):
            self._short_of_highwater_since = None
            return True
        now = time.monotonic()
        if self._short_of_highwater_since is None:
            self._short_of_highwater_since = now
            return False
        if now - self._short_of_highwater_since < OPEN_TRANSACTION_WAIT_S:
            return False
        logger.info("ingest: read to the end but for records of a transaction still open after %.0f s: they are "
                    "read by the next run", OPEN_TRANSACTION_WAIT_S)
        return True


@contextlib.contextmanager
def _bootstrap_errors(bootstrap: str) -> Iterator[None]:
    """A client that cannot bootstrap is a BrokerError naming the setting, not a kafka-python traceback."""
    try:
        yield
    except KafkaTimeoutError as e:  # kafka-python 3: "Unable to bootstrap from ..."
        raise BrokerError(f"cannot reach Kafka at {bootstrap} (kafka.bootstrap): {e}") from e


@contextlib.contextmanager
def _group_errors(group_id: str, session_timeout_ms: int) -> Iterator[None]:
    """What the broker refuses for good when the consumer joins its group or reads (kafka-python raises them
    from `poll`; none is retried), and a batch that cannot be read for want of its codec, is a BrokerError
    naming what to change, not a kafka-python traceback. Nothing is lost: what was read and not committed is
    read again by the next run. (A batch that cannot be read for what it holds is a dead letter instead:
    ingest.record_batches.)"""
    try:
        yield
    except InvalidSessionTimeoutError as e:
        raise BrokerError(f"the broker refused kafka.session_timeout_ms {session_timeout_ms}: it must lie between the "
                          "broker's group.min.session.timeout.ms and group.max.session.timeout.ms (Kafka's defaults: "
                          "6000 and 1800000); change the setting or the broker's limits") from e
    except InconsistentGroupProtocolError as e:
        raise BrokerError(f"consumer group {group_id!r} (kafka.group_id) has members of another application (another "
                          "partition assignment protocol): give clora ingest a group of its own") from e
    except InvalidGroupIdError as e:
        raise BrokerError(f"the broker refused the consumer group id {group_id!r} (kafka.group_id)") from e
    except GroupMaxSizeReachedError as e:
        raise BrokerError(f"consumer group {group_id!r} (kafka.group_id) is full (the broker's group.max.size): run "
                          "fewer ingest processes in it, or raise the limit") from e
    except GroupAuthorizationFailedError as e:
        raise BrokerError(f"not authorised to use consumer group {group_id!r} (kafka.group_id): grant this client "
                          "access to the group") from e
    except TopicAuthorizationFailedError as e:
        raise BrokerError(f"not authorised to read or write a topic ({e}): grant this client access to the topics "
                          "kafka.interactions_topic, kafka.feedback_topic and kafka.dead_letter_topic name") from e
    except UnsupportedCodecError as e:  # each start would stop at the same batch: say what to install
        raise BrokerError(f"a record batch is compressed with a codec this installation cannot read ({e}); clora "
                          "depends on kafka-python[lz4,snappy,zstd]: install its dependencies again") from e
    except CorruptRecordError as e:  # the log itself: skipping it would lose its events without a word
        raise BrokerError(f"{e}: the topic's log is damaged there; repair or delete that partition's segment on the "
                          "broker (clora commits nothing past it, so it is read again from there)") from e


def _names(partitions: list[TopicPartition]) -> str:
    return ",".join(f"{tp.topic}:{tp.partition}" for tp in sorted(partitions)) or "none"
