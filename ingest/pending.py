"""What the store already holds, and which feedback still waits for its interaction.

Design: there is no second store. The Parquet datasets are the durable state of the join:
  - a pending interaction is a row of `interactions/` whose (tenant, id) has no row in `trajectories/`;
  - pending feedback is a row of `feedback/` whose (tenant, id) has no row in `trajectories/`.
Both are written (durably, before offsets are committed) like every other row, so a SIGKILL loses nothing
that was acknowledged, and feedback can meet its interaction days later, across restarts. Nothing is kept
under `state/ingest`; this module only rebuilds, at start and after every partition assignment, an
in-memory view of those datasets (and its interactions index when compaction has left the file list long;
see below):

  interactions    KeyIndex (tenant, id) -> number of the file holding the row (to read it back on a join)
  trajectories    KeyIndex (tenant, id): already scored (the first score wins)
  feedback        KeyIndex (tenant, id, ts, score, source): feedback events already stored (rows.FEEDBACK_KEY;
                  a resent event comes at a new offset, so offsets would not recognise it)
  dead_letters    KeyIndex (topic, partition, offset): rejected messages already stored; the value is
                  SCORER_FAILED where the reason was scorer_error (a replay does not run that scorer again)
  pending         PendingFeedback (tenant, id) -> the first unjoined FeedbackRows of the id, in stream order
                  (at most MAX_WAITING_PER_ID), ingested within the expiry, at most `max_pending_per_tenant`
                  rows per tenant; of the feedback partitions this process reads (OwnedPartitions)
  tenants_on_disk frozenset: tenants with a partition in interactions/, feedback/ or trajectories/ at load
                  (batch.py counts the tenants created on the fly from it)

Memory: 12 bytes per stored row for the indexes (index.py; once retention has deleted more than half of a
dataset's rows, its index is rebuilt from what is stored at the next look at the file list), plus one entry
per piece of feedback that is waiting (feedback for interactions not seen yet), plus the file list below.
Interaction rows themselves stay on disk and are read back only when feedback arrives for them.

Pending feedback is capped per tenant (config `ingest.max_pending_feedback_per_tenant`) and in all
(`ingest.max_pending_feedback`; past it, room is made in the tenant holding the most). Feedback may name
any id (the serving tier's POST /v1/feedback takes whatever id a tenant's key sends), so without a cap a
flood of ids that never arrive would hold ~0.5 KB per event (measured: 460 bytes with 41-character ids,
plus 48 for the tuple holding an id's rows) for the whole expiry, in the process every tenant of its
partitions shares (the caps are per process).
Beyond the cap the tenant's oldest waiting entry leaves memory: it is still in `feedback/` (every feedback
event is written before the join is decided), but an interaction arriving after that is not scored by it (a
later feedback event for the same id waits again). Only feedback without its interaction is ever pending:
feedback for an interaction that has arrived joins at once, so the cap never touches it. At start the same
cap holds: of each tenant's unjoined feedback within the expiry, the first rows of the ids whose first
feedback came last are kept (`_load_pending` picks them in Arrow, one tenant at a time, so a flood on disk
is never turned into Python objects). A tenant scored by a function has none pending, live or loaded: its
feedback scores nothing (batch.py), so the load leaves it out (`load(function_scored=...)`).

Several feedback events for one id: the reward is the first of them (in stream order) whose event time is
within the expiry of its interaction's, however the batches were cut. While feedback waits, its
interaction's time is unknown, and the first event may turn out to lie outside it (a skewed client clock,
an old event sent again) while a later one lies within; keeping only the first per id, as this view did,
made the outcome depend on whether the interaction came in an earlier batch, the same one or a later one.
So an id keeps the rows that came for it, in stream order, and the join takes the first within the expiry
of the interaction when it arrives (batch.py does the same with a batch's feedback for an interaction
already stored, once it has read its time back). Memory stays bounded: at most MAX_WAITING_PER_ID rows per
id, later ones left out (the earlier ones win anyway; only a ninth event for one interaction after eight
outside its expiry is missed), and the caps count rows, not ids. Keeping one row per id and checking the
window against the interaction's time instead works only where that time is known: for a stored
interaction, which is how batch.py handles it, not for one still to come. Nothing new is stored: the rows
are the `feedback/` rows, and a restart takes each id's first MAX_WAITING_PER_ID rows from them (data
written before this loads the same way).

The interactions file list: each write adds a file per tenant, and the index keeps a row's file number, so
the list grows with every write while compaction keeps the files on disk few. A join whose file is gone
follows it to the compacted file holding its rows now (parquet.superseded_by), which that number names from
then on, and reads there the `id` column and the row groups it needs (not the tenant's whole dataset). A
file gone with no compacted successor was pruned (storage.retention): its rows are gone, its number is read
no more, and feedback for them waits as for an interaction not seen. Once the list has grown by
max(live files, stored interactions / 64, RELOAD_MIN_FILES) since the last look, with no write in flight,
it is compared with the live files, and the interactions index is rebuilt from them if the list is over
twice as long (`shrink_files`: the consumer's loop calls it after a commit, never a rebalance callback).
So the list stays within three times the live files plus RELOAD_MIN_FILES entries and ~2.5 bytes per
stored interaction (an entry is a path, ~150 bytes); a rebuild reads every stored interaction id, but only
after 1/64 as many were written since, so it costs at most ~64 id reads per interaction written.

A batch being written: the consumer decides batch N+1 while batch N is still being written, so the view
is told of N's rows when its write starts (`writing_interactions`, `stored_*`), and where its interactions
landed when the write is durable (`interactions_written`); until then N's interaction rows are read from
memory. At most one batch is in flight. If its write fails the process stops (or, in a rebalance, drops
this view), so the view never outlives a row that did not land.

Expiry (`expiry_ms`, config `ingest.pending_expiry_hours`): feedback joins an interaction only when their
event times are at most that far apart; pending feedback leaves memory once it was ingested that long ago
(ids are held in the order their first rows were ingested, so expiry looks only at the oldest; an id with
rows of different ages is handled as `PendingFeedback.expire` says).

A stored file that cannot be read (damaged on disk, or a compacted file whose footer the listing cannot
read, storage.parquet) is logged with what it costs and left out of the load, rather than keeping ingest
from starting for every tenant: its keys are not indexed, so an event of it delivered again is stored a
second time, and feedback in it or for its interactions is not joined.

The join relies on co-partitioning: both topics keyed by tenant with the same partition count, and the
range assignor, so one process sees all of a tenant's interactions and feedback (consumer.py).
What this module leaves to others: deciding what a message means (batch.py) and writing (consumer.py).
"""

from __future__ import annotations

import logging
from collections import OrderedDict, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ingest.index import KeyIndex
from ingest.rows import FEEDBACK_KEY, FEEDBACK_KEY_COLUMNS, FeedbackRow, InteractionRow, interaction_rows
from storage.layout import UNKNOWN_TENANT, StorageError, as_datadir
from storage.parquet import (
    READ_ATTEMPTS,
    damaged,
    live_files,
    live_rows,
    partition_tenants,
    read_file,
    read_rows,
    retry_vanished,
    superseded_by,
    unreadable_files,
)
from storage.schema import FEEDBACK, INTERACTIONS, conform

logger = logging.getLogger(__name__)

Key = tuple[str, str]  # (tenant, id)
_TENANT_ID = attrgetter("tenant", "id")  # the Key of a row

RELOAD_MIN_FILES = 4096  # the file list grows by at least this much between two looks at the live files
ROWS_PER_RELOAD_FILE = 64  # ... and by at least 1/64 of the stored interactions (a rebuild reads them all)
# The key each row of the other datasets is indexed by (rows.FEEDBACK_KEY for feedback).
KEY_COLUMNS = {
    "trajectories": ["tenant", "id"],
    "feedback": list(FEEDBACK_KEY_COLUMNS),
    "dead_letters": ["kafka_topic", "kafka_partition", "kafka_offset"],
}
SCORER_ERROR = "scorer_error"  # the dead-letter reason of an event whose scorer raised or gave a bad value
SCORER_FAILED = 1  # the dead_letters index's value for an offset whose scorer failed (0: any other reason)
MAX_PENDING_PER_TENANT = 100_000  # the default of ingest.max_pending_feedback_per_tenant
MAX_PENDING = 1_000_000  # the default of ingest.max_pending_feedback (every tenant together)
MAX_WAITING_PER_ID = 8  # feedback rows kept for one id whose interaction has not arrived (see the docstring)
# Why pending feedback left memory (the reasons of the pending-dropped counts; it stays in feedback/):
OVER_CAP = "over_cap"  # past the tenant's cap or the total: the oldest waiting row went
PER_ID = "per_id"  # MAX_WAITING_PER_ID rows wait for its id already: the new row is not kept
LOAD_CHUNK = 65_536  # ids checked against the trajectories index at once when pending feedback is loaded
# What ingest gives up for a stored file it cannot read at load (logged with the file).
UNREAD_COST = ("ingest goes on without its rows' keys: an event of it delivered again (a replay, a resend) is "
               "stored a second time, and feedback in it or for its interactions is not joined")
# Where a tenant's partition means it exists (dead_letters/ does not: it held names nobody admitted).
TENANT_DATASETS = ("interactions", "feedback", "trajectories")


class PendingFeedback:
    """(tenant, id) -> the unjoined FeedbackRows of that id in stream order, at most MAX_WAITING_PER_ID of
    them; at most `cap` rows per tenant and `total` in all, the oldest dropped first.

    One insertion-ordered map per tenant (id -> its rows, placed where the id's first row came), so the
    oldest row of a tenant is found and dropped in O(1). Past `total`, room is made in the tenant holding
    the most rows (the one flooding, usually the one adding): a tenant under its fair share keeps its
    feedback while another floods."""

    def __init__(self, cap: int, total: int | None = None) -> None:
        if cap < 1:
            raise ValueError(f"the cap on pending feedback per tenant must be at least 1, got {cap}")
        if total is not None and total < 1:
            raise ValueError(f"the cap on pending feedback in all must be at least 1, got {total}")
        self.cap = cap
        self.total = total
        self.by_tenant: dict[str, OrderedDict[str, tuple[FeedbackRow, ...]]] = {}
        self.held: dict[str, int] = {}  # tenant -> rows it holds (its map counts ids)
        self._size = 0

    def __len__(self) -> int:
        """Rows held (what the caps count), not ids."""
        return self._size

    def __contains__(self, key: Key) -> bool:
        waiting = self.by_tenant.get(key[0])
        return waiting is not None and key[1] in waiting

    def __iter__(self):
        """The keys of the ids that have feedback waiting."""
        for tenant, waiting in self.by_tenant.items():
            for id_ in waiting:
                yield tenant, id_

    def get(self, key: Key) -> tuple[FeedbackRow, ...]:
        """The rows waiting for `key`, in stream order; empty when none."""
        waiting = self.by_tenant.get(key[0])
        return () if waiting is None else waiting.get(key[1], ())

    def add(self, row: FeedbackRow, *, hold_total: bool = True) -> str | None:
        """Keeps `row` after the rows already waiting for its (tenant, id), unless MAX_WAITING_PER_ID wait
        already (the earlier ones come first). Returns why a row left the join, None when none did:
        PER_ID for `row` itself when its id is full; else OVER_CAP for, past the caps, the tenant's oldest,
        or past `total` the oldest of the tenant holding the most. `hold_total=False` leaves `total` to a
        later `fit_total` (a load adds a tenant's rows at once)."""
        waiting = self.by_tenant.get(row.tenant)
        if waiting is None:
            waiting = self.by_tenant[row.tenant] = OrderedDict()
            self.held[row.tenant] = 0
        rows = waiting.get(row.id, ())
        if any(FEEDBACK_KEY(r) == FEEDBACK_KEY(row) for r in rows):
            return None  # the same event again (a replay after a restart, a resend): one place in the join
        if len(rows) >= MAX_WAITING_PER_ID:
            return PER_ID
        waiting[row.id] = (*rows, row)  # an id already waiting keeps its place
        self.held[row.tenant] += 1
        self._size += 1
        if self.held[row.tenant] > self.cap:
            self._drop_oldest(row.tenant, 1)  # one in, one out
            return OVER_CAP
        if hold_total and self.total is not None and self._size > self.total:
            self._drop_oldest(max(self.held, key=self.held.__getitem__), 1)
            return OVER_CAP
        return None

    def fit_total(self) -> int:
        """Drops rows until exactly `total` are left: every tenant above a common level is cut to it (a
        remainder that does not divide evenly goes one each to the largest), each tenant's oldest first.
        Returns how many went."""
        if self.total is None or self._size <= self.total:
            return 0
        order = sorted(self.held, key=self.held.__getitem__)
        room = self.total
        for i, tenant in enumerate(order):  # tenants under an even share of what is left are kept whole
            above = len(order) - i
            share, extra = divmod(room, above)
            if self.held[tenant] > share:
                break
            room -= self.held[tenant]
        dropped = 0
        for k, tenant in enumerate(order[i:]):
            keep = share + (1 if k >= above - extra else 0)
            dropped += self._drop_oldest(tenant, self.held[tenant] - keep)
        return dropped

    def _drop_oldest(self, tenant: str, n: int) -> int:
        """Drops the tenant's `n` oldest rows: the first rows of its first ids (an id whose first rows go
        keeps its place with the rest)."""
        waiting = self.by_tenant[tenant]
        n = max(0, min(n, self.held[tenant]))
        left = n
        while left:
            id_, rows = next(iter(waiting.items()))
            if len(rows) <= left:
                del waiting[id_]
                left -= len(rows)
            else:
                waiting[id_] = rows[left:]
                left = 0
        self._forget(tenant, n)
        return n

    def _forget(self, tenant: str, n: int) -> None:
        """Counts `n` rows of `tenant` as gone (they were taken out of its map)."""
        self.held[tenant] -= n
        self._size -= n
        if not self.by_tenant[tenant]:
            del self.by_tenant[tenant], self.held[tenant]

    def pop(self, key: Key) -> tuple[FeedbackRow, ...]:
        """Takes every row waiting for `key` out (its interaction was scored); empty when none."""
        waiting = self.by_tenant.get(key[0])
        rows = () if waiting is None else waiting.pop(key[1], ())
        if rows:
            self._forget(key[0], len(rows))
        return rows

    def expire(self, cutoff_ms: int) -> int:
        """Drops rows ingested before `cutoff_ms`; returns how many went. Ids are kept in the order their
        first rows were ingested, so only each tenant's first ids are looked at. An id whose older rows
        expire while a newer one does not moves to the back with that one: it is looked at again once the
        ids ahead of it have gone, at most one expiry later than exact, and never holds more than its
        MAX_WAITING_PER_ID rows meanwhile."""
        dropped = 0
        for tenant in list(self.by_tenant):
            waiting = self.by_tenant[tenant]
            gone = 0
            while waiting:
                id_, rows = next(iter(waiting.items()))
                if rows[0].ingested_at >= cutoff_ms:
                    break
                kept = tuple(r for r in rows if r.ingested_at >= cutoff_ms)
                gone += len(rows) - len(kept)
                if kept:
                    waiting[id_] = kept
                    waiting.move_to_end(id_)
                else:
                    del waiting[id_]
            self._forget(tenant, gone)
            dropped += gone
        return dropped


@dataclass(frozen=True)
class OwnedPartitions:
    """The feedback topic's partitions one ingest process reads (`partitions`, of `count`): with several
    processes in a group, the pending feedback it loads is that of those partitions only, which is the
    feedback that reaches it live (the rest waits in the processes that read it). A row stored with no
    partition, or one beyond `count` (the topic made again with fewer), is loaded by the reader of
    partition 0, so every row is loaded by one process, where every process knows the topic's count (one
    that does not loads all). Rows are told apart by partition number only, not topic: a feedback event
    sent to the interactions topic counts as one on the feedback topic's partition of that number, which is
    where it lives when both topics have the same partitions, as the contract asks."""

    partitions: frozenset[int]
    count: int

    def mask(self, partition: pa.ChunkedArray) -> pa.ChunkedArray:
        """Which rows of a `kafka_partition` column this process loads."""
        own = pc.is_in(partition, value_set=pa.array(sorted(self.partitions), pa.int32()))
        if 0 not in self.partitions:
            return pc.fill_null(own, False)
        stray = pc.fill_null(pc.or_(pc.less(partition, 0), pc.greater_equal(partition, self.count)), True)
        return pc.or_(pc.fill_null(own, False), stray)


class PendingStore:
    """In-memory view of the stored datasets; see the module docstring. Build it with `load`."""

    def __init__(self, root: str | Path, *, expiry_ms: int, max_pending_per_tenant: int = MAX_PENDING_PER_TENANT,
                 max_pending: int | None = MAX_PENDING) -> None:
        self.root = as_datadir(root)
        self.expiry_ms = expiry_ms
        self.interactions = KeyIndex()
        self.trajectories = KeyIndex()
        self.feedback = KeyIndex()
        self.dead_letters = KeyIndex()
        self.pending = PendingFeedback(max_pending_per_tenant, max_pending)
        self.tenants_on_disk: frozenset[str] = frozenset()
        self.files: list[str] = []  # interactions file number -> path ("" while its write is in flight, or pruned)
        self.unwritten: dict[Key, InteractionRow] = {}  # interactions of the batch being written
        self._reserved: dict[str, int] = {}  # tenant -> its file number in the batch being written
        self._look_at = 0  # len(files) at which to compare the file list with the live files again
        self.unreadable: set[str] = set()  # stored files the load could not read (logged), left out
        self.topics_since: dict[str, int] = {}  # see `load`

    # --- building -------------------------------------------------------------------------------------

    @classmethod
    def load(
        cls, root: str | Path, *, expiry_ms: int, now_ms: int, max_pending_per_tenant: int = MAX_PENDING_PER_TENANT,
        max_pending: int | None = MAX_PENDING, function_scored: Iterable[str] = (),
        topics_since: dict[str, int] | None = None, owned: OwnedPartitions | None = None,
    ) -> PendingStore:
        """`function_scored`: the tenants the config scores with a function (batch.Processor.functions), whose
        feedback scores nothing, so none of it is loaded to wait (batch.py never adds it live either).
        `owned`: the feedback partitions this process reads, whose unjoined feedback it loads to wait (None:
        all of it).
        `topics_since`: topic -> epoch ms since when its offsets name the messages they name now (a topic
        made again numbers them from 0 again); dead letters ingested before then are left out of the index
        of stored offsets, which would take new messages at those offsets for replays."""
        store = cls(root, expiry_ms=expiry_ms, max_pending_per_tenant=max_pending_per_tenant, max_pending=max_pending)
        store.topics_since = dict(topics_since or {})
        retry_vanished(store._load_interactions, "loading interaction ids")
        for dataset, columns in KEY_COLUMNS.items():
            setattr(store, dataset, retry_vanished(lambda: store._load_index(dataset, columns), f"loading {dataset} keys"))
        left_out = frozenset(function_scored)
        retry_vanished(lambda: store._load_pending(now_ms, left_out, owned), "loading pending feedback")
        retry_vanished(store._report_unreadable_compacted, "listing unreadable files")
        store.tenants_on_disk = frozenset(
            t for dataset in TENANT_DATASETS for t in partition_tenants(store.root, dataset) if t != UNKNOWN_TENANT
        )
        logger.info(
            "store loaded: %d interactions (%d files), %d trajectories, %d feedback, %d dead letters, %d pending "
            "feedback%s", len(store.interactions), len(store.files), len(store.trajectories), len(store.feedback),
            len(store.dead_letters), len(store.pending),
            f"; {len(store.unreadable)} files could not be read (logged above)" if store.unreadable else "",
        )
        return store

    def _load_interactions(self) -> None:
        files = live_files(self.root, "interactions")
        hashes, numbers = [], []
        for number, path in enumerate(files):
            t = self._read_or_skip(path, ["tenant", "id"])
            if t is None:
                continue
            hashes.append(KeyIndex.hash_keys([t.column("tenant").to_pylist(), t.column("id").to_pylist()]))
            numbers.append(np.full(t.num_rows, number, dtype=np.int32))
        self.interactions = KeyIndex.from_hashes(_concat(hashes, np.int64), _concat(numbers, np.int32))
        self.files = files
        self._look_at = self._next_look(len(files))

    def _load_index(self, dataset: str, columns: list[str]) -> KeyIndex:
        """One file at a time, so loading holds one file's Python objects, not the dataset's."""
        hashes = []
        since = self.topics_since if dataset == "dead_letters" else {}
        reasons = dataset == "dead_letters"  # the index's value: whether a scorer failed there
        values = []
        for path in live_files(self.root, dataset):
            t = self._read_or_skip(path, [*columns, *(["ingested_at"] if since else []), *(["reason"] if reasons else [])])
            if t is None:
                continue
            for topic, since_ms in since.items():  # an earlier incarnation's offsets: other messages
                older = pc.and_(pc.equal(t.column("kafka_topic"), topic),
                                pc.less(t.column("ingested_at").cast(pa.int64()), since_ms))
                t = t.filter(pc.invert(pc.fill_null(older, False)))
            # Timestamps as epoch ms, as the rows have them (to_pylist would give datetimes).
            keys = [(t.column(c).cast(pa.int64()) if pa.types.is_timestamp(t.schema.field(c).type) else t.column(c)).to_pylist()
                    for c in columns]
            hashes.append(KeyIndex.hash_keys(keys))
            if reasons:
                failed = pc.fill_null(pc.equal(t.column("reason"), SCORER_ERROR), False)
                values.append(failed.to_numpy(zero_copy_only=False).astype(np.int32) * SCORER_FAILED)
        all_hashes = _concat(hashes, np.int64)
        return KeyIndex.from_hashes(all_hashes, _concat(values, np.int32) if reasons else
                                    np.zeros(len(all_hashes), dtype=np.int32))

    def _load_pending(self, now_ms: int, function_scored: frozenset[str], owned: OwnedPartitions | None = None) -> None:
        """Per tenant, the first MAX_WAITING_PER_ID unjoined rows of each id among what was ingested within
        the expiry, for the ids whose first feedback came last, up to the cap of rows (as if the cap had
        dropped the oldest while they came in). Chosen in Arrow, one tenant at a time, so only the rows
        kept become Python objects. Tenants in `function_scored` are skipped: their feedback would only take
        memory and room under the caps. The config decides at each load, so a tenant moved from a function
        to feedback scoring finds its unjoined feedback of the expiry waiting after the restart. With `owned`,
        only the rows of those feedback partitions (OwnedPartitions)."""
        self.pending = PendingFeedback(self.pending.cap, self.pending.total)
        cutoff = now_ms - self.expiry_ms
        for tenant in partition_tenants(self.root, "feedback"):
            if tenant in function_scored:
                continue
            recent = []
            for path in live_files(self.root, "feedback", tenant):
                t = self._read_or_skip(path, None)
                if t is None:
                    continue
                t = conform(t, FEEDBACK, strict=False, what=path)
                keep = pc.greater_equal(t.column("ingested_at").cast(pa.int64()), cutoff)
                if owned is not None:
                    keep = pc.and_(keep, owned.mask(t.column("kafka_partition")))
                recent.append(t.filter(keep))
            table = pa.concat_tables(recent) if recent else None
            if table is None or not table.num_rows:
                continue
            for row in self._unjoined(tenant, table):
                self.pending.add(row, hold_total=False)  # past the cap, the oldest rows go, as live
            if self.pending.fit_total():  # so at most one tenant's rows beyond the total are ever held
                logger.warning(
                    "more than %d feedback events wait for their interactions in all; the oldest of the tenants "
                    "holding the most are left out of the join (ingest.max_pending_feedback; they stay in feedback/)",
                    self.pending.total,
                )

    def _read_or_skip(self, path: str, columns: list[str] | None) -> pa.Table | None:
        """The file (those columns), or None when it cannot be read: it is logged (once a load) and left out,
        so that one damaged file does not keep ingest from starting for every tenant. A file that vanished
        raises FileNotFoundError (retry_vanished lists again)."""
        try:
            return read_file(self.root, path, columns=columns)
        except Exception as e:
            if isinstance(e, FileNotFoundError) or not damaged(e):
                raise  # vanished (listed again), or this process's trouble (memory, open files): ingest restarts
            if path not in self.unreadable:
                self.unreadable.add(path)
                logger.warning("%s cannot be read (%s: %s); %s", path, type(e).__name__, e, UNREAD_COST)
            return None

    def _report_unreadable_compacted(self) -> None:
        """Compacted files that the listing leaves out (their footer cannot be read; storage.parquet) cost
        ingest the same as a file it cannot read: their keys are not loaded."""
        for dataset in ("interactions", *KEY_COLUMNS):
            for path in unreadable_files(self.root, dataset):
                self.unreadable.add(path)
                logger.warning("%s cannot be read and is left out; %s", path, UNREAD_COST)

    def _unjoined(self, tenant: str, table: pa.Table) -> list[FeedbackRow]:
        """Of one tenant's recent feedback, in the order it came: the first MAX_WAITING_PER_ID rows of each
        id without a trajectory (and, where its interaction is stored, within that interaction's expiry), for
        the ids whose first row came last, until they pass the cap of rows (by at most the rows of the oldest
        id taken, whose first ones `add` then drops)."""
        table = table.sort_by([("ingested_at", "ascending"), ("kafka_offset", "ascending")])
        encoded = pc.dictionary_encode(table.column("id").combine_chunks())
        codes = encoded.indices.to_numpy()  # ids numbered 0..n-1, every number used
        # Rows grouped by id, in stream order within each (a stable sort): where each id's rows start is its
        # first row, and each row's rank among its id's rows says whether it is one of the first kept.
        order = np.argsort(codes, kind="stable")
        starts = np.flatnonzero(np.r_[True, np.diff(codes[order]) != 0])
        counts = np.diff(np.r_[starts, len(codes)])
        rank = np.empty(len(codes), dtype=np.int64)
        rank[order] = np.arange(len(codes)) - np.repeat(starts, counts)
        first_row, kept_rows = order[starts], np.minimum(counts, MAX_WAITING_PER_ID)  # by id number
        # Ids newest first (by their first row), walked until their rows without a trajectory pass the cap.
        newest_first = np.argsort(first_row)[::-1]
        cap, chosen, held = self.pending.cap, [], 0
        stored_unscored: set[Key] = set()  # checked against their interactions below
        for start in range(0, len(newest_first), LOAD_CHUNK):
            numbers = newest_first[start:start + LOAD_CHUNK]
            ids = encoded.dictionary.take(pa.array(numbers)).to_pylist()
            scored = self.trajectories.present((tenant, id_) for id_ in ids)
            stored = self.interactions.present([(tenant, id_) for id_ in ids])
            for number, id_ in zip(numbers, ids):
                if (tenant, id_) not in scored:
                    chosen.append(number)
                    held += int(kept_rows[number])
                    if (tenant, id_) in stored:
                        stored_unscored.add((tenant, id_))
                    if held > cap:
                        break
            if held > cap:
                logger.warning(
                    "tenant %s: more than %d feedback events wait for their interactions; the oldest are left out "
                    "of the join (ingest.max_pending_feedback_per_tenant; they stay in feedback/)", tenant, cap,
                )
                break
        keep = np.flatnonzero(np.isin(codes, np.asarray(chosen, dtype=codes.dtype)) & (rank < MAX_WAITING_PER_ID))
        chosen_rows = table.take(pa.array(keep, pa.int64()))
        ms = {c: chosen_rows.column(c).cast(pa.int64()).to_pylist() for c in ("ts", "ingested_at")}
        columns = [ms[f] if f in ms else chosen_rows.column(f).to_pylist() for f in FeedbackRow._fields]
        rows = [FeedbackRow(*values) for values in zip(*columns)]
        if not stored_unscored:
            return rows
        # Feedback for an interaction stored but not scored: outside its expiry, it joins nothing (nor is it
        # pending while ingest runs: batch.py tries it once against the stored row). Within it, the
        # trajectory's write was lost (a crash between the batch's files; its offsets were not committed),
        # and the interaction, read again, must find it waiting to derive the trajectory anew.
        interactions = self.fetch_interactions(stored_unscored)
        return [fb for fb in rows if (key := _TENANT_ID(fb)) not in stored_unscored
                or (key in interactions and self.within_expiry(fb.ts, interactions[key].ts))]

    # --- questions ------------------------------------------------------------------------------------

    def within_expiry(self, a_ms: int, b_ms: int) -> bool:
        return abs(a_ms - b_ms) <= self.expiry_ms

    def fetch_interactions(self, keys: Iterable[Key]) -> dict[Key, InteractionRow]:
        """Reads back stored interaction rows, one read per file that holds some of them."""
        wanted: dict[int, set[str]] = defaultdict(set)  # file number -> ids
        found: dict[Key, InteractionRow] = {}
        for tenant, id_ in keys:
            row = self.unwritten.get((tenant, id_))
            if row is not None:  # its write is still in flight
                found[(tenant, id_)] = row
                continue
            number = self.interactions.get((tenant, id_))
            if number is not None and self.files[number]:  # not a hash collision with a row in flight
                wanted[number].add(id_)
        for table in self._read_interactions(wanted):
            for row in interaction_rows(table):
                found.setdefault((row.tenant, row.id), row)
        return found

    def _read_interactions(self, wanted: dict[int, set[str]]) -> list[pa.Table]:
        """The rows of the ids wanted from each file number, one read per file. A file compaction deleted is
        followed to the compacted file holding its rows now, which its file number names from then on."""
        tables = []
        for _ in range(READ_ATTEMPTS):
            numbers_in: dict[str, list[int]] = defaultdict(list)
            for number in wanted:
                numbers_in[self.files[number]].append(number)
            moved: dict[int, set[str]] = {}
            for path, numbers in numbers_in.items():
                ids = set().union(*(wanted[n] for n in numbers))
                try:
                    tables.append(self._read_ids(path, ids))
                    continue
                except FileNotFoundError:
                    holder = superseded_by(self.root, path)
                if holder is None:  # pruned (storage.retention), or deleted by hand: its rows are gone
                    logger.info("interactions file %s was deleted (retention); feedback for its %d ids waits "
                                "until it expires", path, len(ids))
                    for n in numbers:
                        self.files[n] = ""  # read no more (as rows in flight are not)
                    continue
                logger.debug("interactions file %s was compacted into %s", path, holder)
                for n in numbers:
                    self.files[n] = holder
                    moved[n] = wanted[n]
            if not moved:
                return tables
            wanted = moved
        raise StorageError(f"interactions files kept being compacted away while reading: {sorted({self.files[n] for n in wanted})}")

    def _read_ids(self, path: str, ids: set[str]) -> pa.Table:
        """The rows of one file with `ids`: its id column, then only the row groups holding them."""
        column = read_file(self.root, path, columns=["id"]).column("id")
        positions = pc.indices_nonzero(pc.is_in(column, value_set=pa.array(sorted(ids), pa.string())))
        return conform(read_rows(self.root, path, positions.to_pylist()), INTERACTIONS, strict=False, what=path)

    # --- after a write (started, or durable) ----------------------------------------------------------

    def writing_interactions(self, rows: list[InteractionRow], keys: list[Key] | None = None) -> None:
        """Indexes rows whose write has started: one file number per tenant is reserved, and the rows are
        read from memory until `interactions_written` says where they landed. `keys`: the rows' (tenant, id),
        when the caller has them."""
        if self._reserved:
            raise RuntimeError(f"interactions of {len(self.unwritten)} rows are still being written: one batch at a time")
        if keys is None:
            keys = list(map(_TENANT_ID, rows))
        tenants = [key[0] for key in keys]
        for tenant in sorted(set(tenants)):
            self._reserved[tenant] = len(self.files)
            self.files.append("")
        self.interactions.add_many(keys, map(self._reserved.__getitem__, tenants))
        self.unwritten = dict(zip(keys, rows))

    def interactions_written(self, paths: list[Path]) -> None:
        """The rows of `writing_interactions` are durable in `paths` (one per tenant:
        <dataset>/tenant=<t>/<file>.parquet)."""
        for path in paths:
            self.files[self._reserved.pop(path.parent.name.removeprefix("tenant="))] = str(path)
        if self._reserved:
            raise RuntimeError(f"no interactions file came back for tenants {sorted(self._reserved)}")
        self.unwritten = {}

    def shrink_files(self) -> None:
        """Compares the file list with the live files (`_shrink_files`) if it has grown enough since the last
        look and no write is in flight. Left to the caller, not done on `interactions_written`: the consumer
        also waits for a write inside Kafka's rebalance callbacks, where a rebuild (it reads every stored
        interaction id) would hold up the group, for a view that is dropped right after. The loop calls this
        after each commit."""
        if not self._reserved and len(self.files) >= self._look_at:
            self._shrink_files()
            self._shrink_indexes()

    def _next_look(self, live: int) -> int:
        return len(self.files) + max(live, len(self.interactions) // ROWS_PER_RELOAD_FILE, RELOAD_MIN_FILES)

    def _shrink_files(self) -> None:
        """Rebuilds the interactions index from the live files if the file list is over twice as long (most
        of it then names files compaction merged). No write is in flight, so the datasets hold every row the
        index knows. A failure leaves the index as it was (it is still right) and is tried again later."""
        try:
            live = len(retry_vanished(lambda: live_files(self.root, "interactions"), "listing interactions"))
            if len(self.files) > 2 * live:
                before = len(self.files)
                retry_vanished(self._load_interactions, "reloading interaction ids")
                logger.info("interactions index rebuilt: %d file numbers -> %d live files", before, len(self.files))
                return
        except Exception:
            logger.exception("could not rebuild the interactions index; keeping it as it is")
            live = 0
        self._look_at = self._next_look(live)

    def _shrink_indexes(self) -> None:
        """Rebuilds the trajectories, feedback and dead-letter key indexes, each from its live files, if it
        knows over twice the rows stored there: retention (storage.retention) deleted the rest, and without
        this a process that runs for months would hold 12 bytes for every row it ever stored. The row counts
        come from the files' footers. No write is in flight (see `_shrink_files`). A failure keeps the index
        (it is still right) and is tried again at the next look."""
        for dataset, columns in KEY_COLUMNS.items():
            index = getattr(self, dataset)
            try:
                stored = retry_vanished(lambda: live_rows(self.root, dataset), f"counting {dataset} rows")
                if len(index) > 2 * stored:
                    setattr(self, dataset, retry_vanished(lambda: self._load_index(dataset, columns), f"reloading {dataset} keys"))
                    logger.info("%s index rebuilt: %d keys -> %d stored rows", dataset, len(index), len(getattr(self, dataset)))
            except Exception:
                logger.exception("could not rebuild the %s index; keeping it as it is", dataset)

    def stored_trajectories(self, keys: list[Key]) -> None:
        self.trajectories.add_many(keys)
        for key in keys:
            self.pending.pop(key)

    def stored_feedback(self, keys: list[tuple]) -> None:
        self.feedback.add_many(keys)

    def stored_dead_letters(self, offsets: list[tuple[str, int, int]], reasons: list[str]) -> None:
        self.dead_letters.add_many(offsets, [SCORER_FAILED if r == SCORER_ERROR else 0 for r in reasons])

    def expire(self, now_ms: int) -> int:
        """Drops pending feedback ingested more than the expiry ago; returns how many went."""
        return self.pending.expire(now_ms - self.expiry_ms)


def _concat(arrays: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(arrays) if arrays else np.empty(0, dtype=dtype)
