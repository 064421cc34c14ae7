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
  dead_letters    KeyIndex (topic, partition, offset): rejected messages already stored
  pending         dict (tenant, id) -> the earliest unjoined FeedbackRow, ingested within the expiry

Memory: 12 bytes per stored row for the indexes (index.py), plus one entry per piece of feedback that is
waiting (feedback for interactions not seen yet: rare, and dropped from memory after the expiry), plus the
file list below. Interaction rows themselves stay on disk and are read back only when feedback arrives for
them.

The interactions file list: each write adds a file per tenant, and the index keeps a row's file number, so
the list grows with every write while compaction keeps the files on disk few. A join whose file is gone
follows it to the compacted file holding its rows now (parquet.superseded_by), which that number names from
then on, and reads there the `id` column and the row groups it needs (not the tenant's whole dataset, which
is left for a file deleted by something other than compaction). Once the list has grown by
max(live files, stored interactions / 64, RELOAD_MIN_FILES) since the last look, with no write in flight,
it is compared with the live files, and the interactions index is rebuilt from them if the list is over
twice as long. So the list stays within three times the live files plus RELOAD_MIN_FILES entries and
~2.5 bytes per stored interaction (an entry is a path, ~150 bytes); a rebuild reads every stored
interaction id, but only after 1/64 as many were written since, so it costs at most ~64 id reads per
interaction written.

A batch being written: the consumer decides batch N+1 while batch N is still being written, so the view
is told of N's rows when its write starts (`writing_interactions`, `stored_*`), and where its interactions
landed when the write is durable (`interactions_written`); until then N's interaction rows are read from
memory. At most one batch is in flight. If its write fails the process stops (or, in a rebalance, drops
this view), so the view never outlives a row that did not land.

Expiry (`expiry_ms`, config `ingest.pending_expiry_hours`): feedback joins an interaction only when their
event times are at most that far apart; pending feedback leaves memory once it was ingested that long ago.

The join relies on co-partitioning: both topics keyed by tenant with the same partition count, and the
range assignor, so one process sees all of a tenant's interactions and feedback (consumer.py).
What this module leaves to others: deciding what a message means (batch.py) and writing (consumer.py).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ingest.index import KeyIndex
from ingest.rows import FEEDBACK_KEY_COLUMNS, FeedbackRow, InteractionRow, interaction_rows
from storage.layout import StorageError, as_datadir
from storage.parquet import READ_ATTEMPTS, live_files, read_dataset, read_file, read_rows, retry_vanished, superseded_by
from storage.schema import FEEDBACK, INTERACTIONS, conform

logger = logging.getLogger(__name__)

Key = tuple[str, str]  # (tenant, id)

RELOAD_MIN_FILES = 4096  # the file list grows by at least this much between two looks at the live files
ROWS_PER_RELOAD_FILE = 64  # ... and by at least 1/64 of the stored interactions (a rebuild reads them all)


class PendingStore:
    """In-memory view of the stored datasets; see the module docstring. Build it with `load`."""

    def __init__(self, root: str | Path, *, expiry_ms: int) -> None:
        self.root = as_datadir(root)
        self.expiry_ms = expiry_ms
        self.interactions = KeyIndex()
        self.trajectories = KeyIndex()
        self.feedback = KeyIndex()
        self.dead_letters = KeyIndex()
        self.pending: dict[Key, FeedbackRow] = {}
        self.files: list[str] = []  # interactions file number -> path ("" while its write is in flight)
        self.unwritten: dict[Key, InteractionRow] = {}  # interactions of the batch being written
        self._reserved: dict[str, int] = {}  # tenant -> its file number in the batch being written
        self._look_at = 0  # len(files) at which to compare the file list with the live files again

    # --- building -------------------------------------------------------------------------------------

    @classmethod
    def load(cls, root: str | Path, *, expiry_ms: int, now_ms: int) -> PendingStore:
        store = cls(root, expiry_ms=expiry_ms)
        retry_vanished(store._load_interactions, "loading interaction ids")
        store.trajectories = retry_vanished(lambda: store._load_index("trajectories", ["tenant", "id"]), "loading trajectory ids")
        store.feedback = retry_vanished(
            lambda: store._load_index("feedback", list(FEEDBACK_KEY_COLUMNS)), "loading feedback keys"
        )
        store.dead_letters = retry_vanished(
            lambda: store._load_index("dead_letters", ["kafka_topic", "kafka_partition", "kafka_offset"]),
            "loading dead-letter offsets",
        )
        retry_vanished(lambda: store._load_pending(now_ms), "loading pending feedback")
        logger.info(
            "store loaded: %d interactions (%d files), %d trajectories, %d feedback, %d dead letters, %d pending feedback",
            len(store.interactions), len(store.files), len(store.trajectories), len(store.feedback),
            len(store.dead_letters), len(store.pending),
        )
        return store

    def _load_interactions(self) -> None:
        files = live_files(self.root, "interactions")
        hashes, numbers = [], []
        for number, path in enumerate(files):
            t = read_file(self.root, path, columns=["tenant", "id"])
            hashes.append(KeyIndex.hash_keys([t.column("tenant").to_pylist(), t.column("id").to_pylist()]))
            numbers.append(np.full(t.num_rows, number, dtype=np.int32))
        self.interactions = KeyIndex.from_hashes(_concat(hashes, np.int64), _concat(numbers, np.int32))
        self.files = files
        self._look_at = self._next_look(len(files))

    def _load_index(self, dataset: str, columns: list[str]) -> KeyIndex:
        """One file at a time, so loading holds one file's Python objects, not the dataset's."""
        hashes = []
        for path in live_files(self.root, dataset):
            t = read_file(self.root, path, columns=columns)
            # Timestamps as epoch ms, as the rows have them (to_pylist would give datetimes).
            values = [(t.column(c).cast(pa.int64()) if pa.types.is_timestamp(t.schema.field(c).type) else t.column(c)).to_pylist()
                      for c in columns]
            hashes.append(KeyIndex.hash_keys(values))
        all_hashes = _concat(hashes, np.int64)
        return KeyIndex.from_hashes(all_hashes, np.zeros(len(all_hashes), dtype=np.int32))

    def _load_pending(self, now_ms: int) -> None:
        """The earliest unjoined feedback per (tenant, id) among what was ingested within the expiry."""
        self.pending = {}
        cutoff = now_ms - self.expiry_ms
        recent = []
        for path in live_files(self.root, "feedback"):
            t = conform(read_file(self.root, path), FEEDBACK, strict=False)
            recent.append(t.filter(pc.greater_equal(t.column("ingested_at").cast(pa.int64()), cutoff)))
        if not recent:
            return
        table = pa.concat_tables(recent).sort_by([("ingested_at", "ascending"), ("kafka_offset", "ascending")])
        ms = {c: table.column(c).cast(pa.int64()).to_pylist() for c in ("ts", "ingested_at")}
        columns = [ms[f] if f in ms else table.column(f).to_pylist() for f in FeedbackRow._fields]
        for values in zip(*columns):
            row = FeedbackRow(*values)
            key = (row.tenant, row.id)
            if key not in self.pending and key not in self.trajectories:
                self.pending[key] = row

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
                if holder is None:  # deleted by something other than compaction
                    tenant = Path(path).parent.name.removeprefix("tenant=")
                    logger.warning("interactions file %s is gone; reading tenant %s's live files", path, tenant)
                    table = read_dataset(self.root, "interactions", tenant)
                    tables.append(table.filter(pc.is_in(table.column("id"), value_set=pa.array(sorted(ids), pa.string()))))
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
        return conform(read_rows(self.root, path, positions.to_pylist()), INTERACTIONS, strict=False)

    # --- after a write (started, or durable) ----------------------------------------------------------

    def writing_interactions(self, rows: list[InteractionRow]) -> None:
        """Indexes rows whose write has started: one file number per tenant is reserved, and the rows are
        read from memory until `interactions_written` says where they landed."""
        if self._reserved:
            raise RuntimeError(f"interactions of {len(self.unwritten)} rows are still being written: one batch at a time")
        for tenant in sorted({r.tenant for r in rows}):
            self._reserved[tenant] = len(self.files)
            self.files.append("")
        self.interactions.add_many([(r.tenant, r.id) for r in rows], [self._reserved[r.tenant] for r in rows])
        self.unwritten = {(r.tenant, r.id): r for r in rows}

    def interactions_written(self, paths: list[Path]) -> None:
        """The rows of `writing_interactions` are durable in `paths` (one per tenant:
        <dataset>/tenant=<t>/<file>.parquet)."""
        for path in paths:
            self.files[self._reserved.pop(path.parent.name.removeprefix("tenant="))] = str(path)
        if self._reserved:
            raise RuntimeError(f"no interactions file came back for tenants {sorted(self._reserved)}")
        self.unwritten = {}
        if len(self.files) >= self._look_at:
            self._shrink_files()

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

    def stored_trajectories(self, keys: list[Key]) -> None:
        self.trajectories.add_many(keys)
        for key in keys:
            self.pending.pop(key, None)

    def stored_feedback(self, keys: list[tuple]) -> None:
        self.feedback.add_many(keys)

    def stored_dead_letters(self, offsets: list[tuple[str, int, int]]) -> None:
        self.dead_letters.add_many(offsets)

    def expire(self, now_ms: int) -> int:
        """Drops pending feedback ingested more than the expiry ago; returns how many went."""
        old = [k for k, row in self.pending.items() if now_ms - row.ingested_at > self.expiry_ms]
        for k in old:
            del self.pending[k]
        return len(old)


def _concat(arrays: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(arrays) if arrays else np.empty(0, dtype=dtype)
