"""The learner's per-tenant cursor: which trajectories it has trained on, committed with its checkpoint.

On disk, per tenant:
    cursors/<tenant>/step-<step>/commit.json     {"format", "tenant", "step", "n_ids", "created_at"}
    cursors/<tenant>/step-<step>/ids.parquet     the trajectory ids trained at that step
    cursors/<tenant>/step-<step>/checkpoint/     what the learner's checkpoint(dir) wrote (adapter + optimizer)
    cursors/<tenant>/trained-<first>-<last>.parquet   snapshot: every id trained at steps first..last
    cursors/<tenant>/horizon.json                 {"format", "through", "before_ms"}: what retention forgot

`commit` builds a step directory under a hidden staging name (checkpoint files, ids, commit.json), fsyncs
it and renames it into place: the ids and the checkpoint become visible together or not at all. Only the
newest `keep_checkpoints` step directories keep their checkpoint/; older ones keep just their ids.

The cursor is a set of trajectory *ids*, never file names or offsets, so compaction of the trajectory
files (which renames and merges them) cannot move it. `compact` folds the per-step id files into a
snapshot so a learner restart reads a few files, not one per step ever taken. Snapshots are tiered, so a
compaction costs the steps it folds, not the history (a learner compacts every 100 steps, for ever): the
new steps become one snapshot, which is merged with the one before while it holds at least as many ids,
and so on (a binary counter). Every id is rewritten about log2(compactions) times in all (~10 after 1,000
compactions, where rewriting the history each time would be ~500). The counter runs within one UTC day of
commits: a snapshot is dated by its newest commit, the first compaction of a new day merges the day before
into one snapshot, and snapshots of different days are never merged (so retention can drop a day whole,
below). A cursor is thus a chain of one snapshot per earlier day plus ~log2(today's compactions):
first..last ranges that follow one another from step 0 (a snapshot named `trained-<last>.parquet`, which
older versions wrote, is the range 0..last).
After a crash between writing a merged snapshot and deleting what it merged, both are there: readers
take, from each starting step, the snapshot that reaches furthest, and the next compaction deletes the
ones no chain uses.

Retention (`forget`, which `clora prune` and the compactor call with the retention's cutoff): a cursor
would otherwise hold every id ever trained (the backlog's fingerprints below grow by ~140 MB a day at 100
trajectories/s, and a cold start reads them all). The snapshots at the head of the chain whose steps were
all committed more than FORGET_MARGIN_MS before the cutoff (each snapshot records its newest commit time;
one written before that was recorded is dated by its file) are forgotten: horizon.json says "steps <=
through are forgotten, and trajectories ingested before before_ms are left out of the backlog", and the
chain starts after `through`. A row trained at a forgotten step was ingested before its commit, so before
the cutoff: leaving those rows out keeps every trained row out without its id. An untrained row that old
is left out too (retention deletes its file). Step numbers go on after `through`. Since snapshots hold one
day each, a cursor holds the retention period's ids plus at most a day and the margin (before snapshots
were kept apart by day, a merge dated old ids by the newest ones merged with them, and a cursor could
hold ~2.5 retention periods). Older clora versions do not read horizon.json: after a `forget`, do not go
back to one.

Reads are lock-free; `commit`, `compact` and `forget` take a per-tenant lock (one learner owns a tenant at
a time).

The backlog (`untrained`, `backlog`; the learner asks every pass, ingest adds a file about once a second
per tenant) is kept per tenant and brought up to date on each call, so a pass costs what changed since the
last one, not the history:
  - the trained ids are held as 128-bit fingerprints (a hashindex.HashIndex): 16 bytes per trained id,
    the only memory that grows with the history (8.6 million ids, a day at 100 trajectories/s: ~140 MB;
    for a moment twice that when a merge grows the largest run, each time the history grows by 1/16; ids
    are read and added a batch at a time, so a cold start holds no second copy of them). A step committed
    since the last call is read once and its ids added;
  - a trajectories file keeps only its untrained rows (id, ingested_at, row, fingerprint: ~80 bytes each,
    in one `pending` table); a fully trained file costs a dictionary entry, whatever its size. The pending
    rows (the backlog) are checked again only when new ids were added: the trained set only grows;
  - a file listed for the first time (ingest's new file, or a compacted file replacing others, which holds
    their rows, trained ones included) is read once and its rows checked against the fingerprints; a file
    no longer listed takes its pending rows with it.
A pass is thus two directory listings, the new files and step files, and arrow work on the backlog.
Everything is read once when a Cursors starts (after a crash or restart), and when the cursor cannot be
followed step by step: a snapshot that folded steps this instance never read (a compaction by another
process while it was not looking; the snapshot is read and merged) or a cursor that went back (deleted by
hand; the tenant is read again from scratch, if the next call sees it behind what was read: a cursor
deleted and committed past its old step in between goes unnoticed until the next start), and when the
horizon moved (the forgotten fingerprints go with the old state).

Fingerprints are hashindex.hash_strings of the id: two 64-bit SipHash values, keyed per process and kept
in memory only. A stored row would be taken for trained only if its fingerprint equalled a trained id's:
about n / 2**128 per row for n trained ids, 3e-30 at a billion ids (with one 64-bit hash, n / 2**64: about
a one-in-four chance of one skipped trajectory in a year at 100 trajectories/s).

What this module does not do: decide what to train (the learner's scheduler) or read checkpoints.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from storage.files import (
    FileLock,
    atomic_write_bytes,
    ensure_dir,
    fsync_dir,
    fsync_tree,
    publish_dir,
    remove_stale_hidden,
    remove_tree,
    write_new_file,
)
from storage.hashindex import HashIndex, hash_strings
from storage.layout import StorageError, as_datadir, check_tenant, is_tenant
from storage.parquet import damaged, live_files, partition_tenants, read_file, read_rows, retry_vanished
from storage.schema import TRAJECTORIES, conform

logger = logging.getLogger(__name__)

FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d{20})$")
_SNAPSHOT = re.compile(r"^trained-(?:(\d{20})-)?(\d{20})\.parquet$")  # first (0 when absent), last
_INDEX_SCHEMA = pa.schema([TRAJECTORIES.field("id"), TRAJECTORIES.field("ingested_at")])
_CURSOR_FORMAT = b"clora.cursor_format"  # ids files' metadata: FORMAT
_IDS_SCHEMA = pa.schema([pa.field("id", pa.string(), nullable=False)], metadata={_CURSOR_FORMAT: str(FORMAT).encode()})
# Untrained rows and where they are. `file` is a file's number in _Backlog.files (pending rows, which also
# carry the id's fingerprint) or its position in the listed paths (the index that `untrained` sorts).
_ROWS_SCHEMA = pa.schema([*_INDEX_SCHEMA, pa.field("file", pa.int32()), pa.field("row", pa.int64())])
_PENDING_SCHEMA = pa.schema([*_ROWS_SCHEMA, pa.field("hi", pa.int64()), pa.field("lo", pa.int64())])  # + fingerprint
_READ_BATCH = 65536  # ids read at a time from a snapshot (bounds what a long history holds in memory)
_HORIZON = "horizon.json"
_NEWEST_COMMIT = b"clora.newest_commit_ms"  # snapshot metadata: the newest commit time of its steps
# A snapshot is forgotten only once its newest commit is this much older than the cutoff, so a row it
# trained was ingested before the cutoff even if the learner's clock ran this much behind ingest's.
FORGET_MARGIN_MS = 3_600_000
# What a fold replaced (snapshots, step files) is deleted by a later compaction once the snapshot holding it
# is this old (Cursors._remove_folded).
FOLD_GRACE_S = 60.0
# Snapshots are dated by the UTC day of their newest commit, and those of different days are never merged, so
# retention can forget a whole day once it is old (see the module note).
DAY_MS = 86_400_000


class CursorError(StorageError):
    """A commit that would break the cursor (a step that is not newer than the last one)."""


KEEP_DAMAGED = 3  # damaged checkpoints kept per tenant for a look (each the size of a checkpoint)


def _step_name(step: int) -> str:
    return f"step-{step:020d}"


@dataclass(frozen=True, order=True)
class _Snapshot:
    first: int
    last: int
    path: Path = field(compare=False)


def _snapshot_name(first: int, last: int) -> str:
    return f"trained-{first:020d}-{last:020d}.parquet"


@dataclass(frozen=True)
class Horizon:
    """What retention made the cursor forget: the ids of every step <= `through`, and with them every
    trajectory ingested before `before_ms`, trained or not (it is never trained: see `Cursors.forget`)."""

    through: int = -1
    before_ms: int | None = None


def _chain(snapshots: list[_Snapshot], horizon: Horizon = Horizon()) -> list[_Snapshot]:
    """The snapshots that hold the cursor: from the step after the horizon (0 without one), each time the
    one starting where the last ended that reaches furthest (a crash may leave a merged snapshot beside the
    ones it merged)."""
    by_first: dict[int, _Snapshot] = {}
    for snap in snapshots:
        if snap.first not in by_first or snap.last > by_first[snap.first].last:
            by_first[snap.first] = snap
    chain, at = [], horizon.through + 1
    while at in by_first:
        chain.append(by_first[at])
        at = by_first[at].last + 1
    return chain


def _rows(path: Path) -> int:
    with pq.ParquetFile(path) as f:
        return f.metadata.num_rows


def _newest_commit_ms(path: Path) -> int:
    """A snapshot's newest commit time: from its metadata, else (written before it was recorded) the later
    of its mtime and ctime, which are later than any commit it holds (a copy or a restore may set the mtime
    back, not the ctime)."""
    with pq.ParquetFile(path) as f:
        value = (f.schema_arrow.metadata or {}).get(_NEWEST_COMMIT)
    if value is not None:
        return int(value)
    st = path.stat()
    return int(max(st.st_mtime, st.st_ctime) * 1000)


def _step_commit_ms(step_dir: Path) -> int:
    try:
        created = json.loads((step_dir / "commit.json").read_text())["created_at"]
        return int(datetime.fromisoformat(created).timestamp() * 1000)
    except (OSError, ValueError, KeyError, TypeError):
        return int((step_dir / "ids.parquet").stat().st_mtime * 1000)


def _merged(tenant_dir: Path, run: list[_Snapshot]) -> _Snapshot:
    """One snapshot holding the consecutive snapshots of `run`, written durably; they stay until a later
    compaction finds it FOLD_GRACE_S old (Cursors.compact), which readers handle (the chain takes the
    furthest-reaching snapshot)."""
    merged = _Snapshot(run[0].first, run[-1].last, tenant_dir / _snapshot_name(run[0].first, run[-1].last))
    _write_ids(merged.path, [snap.path for snap in run], max(_newest_commit_ms(snap.path) for snap in run))
    return merged


def _covered_long_enough(first: int, last: int, chain: list[_Snapshot], now_s: float) -> bool:
    """Whether a snapshot of `chain` FOLD_GRACE_S old or older holds steps first..last."""
    for snap in chain:
        if snap.first <= first and last <= snap.last:
            try:
                return now_s - snap.path.stat().st_mtime >= FOLD_GRACE_S
            except FileNotFoundError:
                return False
    return False


def _id_batches(path: Path) -> Iterator[pa.Array]:
    """The ids of a step's ids.parquet or of a snapshot, _READ_BATCH at a time. A file of a cursor format
    other than this clora's raises StorageError (a newer clora's would be misread)."""
    with pq.ParquetFile(path) as ids_file:
        found = (ids_file.schema_arrow.metadata or {}).get(_CURSOR_FORMAT, str(FORMAT).encode())
        if found != str(FORMAT).encode():
            raise StorageError(f"{path} has cursor format {found.decode(errors='replace')!r}; this clora reads "
                               f"{FORMAT}: it was written by another version of clora (upgrade this one)")
        for batch in ids_file.iter_batches(batch_size=_READ_BATCH, columns=["id"]):
            yield batch.column("id")


def _write_ids(final: Path, sources: list[Path], newest_commit_ms: int) -> None:
    """One ids file from `sources`, streamed (one batch of ids in memory at a time), written durably. An id
    in two sources (the learner never commits one twice) would be kept twice; readers take a set."""
    schema = _IDS_SCHEMA.with_metadata({**_IDS_SCHEMA.metadata, _NEWEST_COMMIT: str(newest_commit_ms).encode()})

    def write(tmp: Path) -> None:
        with pq.ParquetWriter(tmp, schema) as out:
            for path in sources:
                for ids in _id_batches(path):
                    out.write_batch(pa.record_batch([ids], schema=schema))

    write_new_file(final, write)


@dataclass
class _Backlog:
    """One tenant's untrained trajectories, brought up to date by Cursors._untrained_index."""

    horizon: Horizon = field(default_factory=Horizon)  # the one this state was built under
    trained: HashIndex = field(default_factory=HashIndex)  # fingerprints of the trained ids
    through: int = -1  # the ids of every step <= through are in `trained`
    files: dict[str, int] = field(default_factory=dict)  # every live trajectories file read -> its number
    next_file: int = 0
    pending: pa.Table = field(default_factory=_PENDING_SCHEMA.empty_table)  # untrained rows of `files`
    # files of `files` whose content cannot be read (no rows taken) -> their (size, mtime) then: read again
    # once that changes (restored in place)
    damaged: dict[str, tuple] = field(default_factory=dict)
    # What the last call listed (file paths, cursor snapshots and steps) and what it answered from that.
    listing: tuple = ()
    index: pa.Table = field(default_factory=_ROWS_SCHEMA.empty_table)
    distinct: int = 0


def _moved(state: _Backlog, horizon: Horizon) -> _Backlog:
    """`state` under a new horizon: the files read and their untrained rows stay (forgetting trains nothing),
    less the rows ingested before the horizon; the trained fingerprints start over (the caller reads the
    cursor after the horizon again), which is what frees the forgotten ones."""
    pending = state.pending
    if horizon.before_ms is not None and pending.num_rows:
        pending = pending.filter(pc.greater_equal(pending.column("ingested_at").cast(pa.int64()), horizon.before_ms))
    return _Backlog(horizon=horizon, through=horizon.through, files=state.files, next_file=state.next_file, pending=pending,
                    damaged=state.damaged)


class Cursors:
    def __init__(self, root, *, keep_checkpoints: int = 2):
        if keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be at least 1, got {keep_checkpoints}")
        self.dd = as_datadir(root)
        self.keep_checkpoints = keep_checkpoints
        self._backlogs: dict[str, _Backlog] = {}  # tenant -> its untrained rows (see the module note)
        # tenant -> why its backlog could not be read at the last `backlog` call (it is left out of the answer)
        self.backlog_errors: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"Cursors({str(self.dd.root)!r})"

    # --- reading the cursor ---------------------------------------------------------------------------
    def tenants(self) -> list[str]:
        """The tenants with a cursor, sorted (a directory left by hand, "_old" or ".x", is not one)."""
        return sorted(p.name for p in self.dd.cursors.glob("*") if p.is_dir() and is_tenant(p.name))

    def trained_ids(self, tenant: str) -> set[str]:
        return set(self._trained(tenant))

    def latest_checkpoint(self, tenant: str) -> tuple[int, Path] | None:
        """(step, checkpoint dir) of the newest committed step; None before the first commit."""
        for step, path in reversed(self._steps(tenant)):
            if (path / "checkpoint").is_dir():
                return step, path / "checkpoint"
        return None

    def latest_step(self, tenant: str) -> int | None:
        snapshots, steps = self._listing(tenant)
        through = self.horizon(tenant).through
        return max([s for s, _ in steps] + [snap.last for snap in snapshots] + ([through] if through >= 0 else []),
                   default=None)

    def horizon(self, tenant: str) -> Horizon:
        """What retention made the tenant's cursor forget (`forget`); Horizon() when nothing."""
        path = self.dd.tenant_cursors(tenant) / _HORIZON
        try:
            data = json.loads(path.read_bytes())
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
            return Horizon(int(data["through"]), int(data["before_ms"]))
        except FileNotFoundError:
            return Horizon()
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise StorageError(f"{path} is unreadable ({e}); it is written only by `clora prune` and the "
                               "compactor: restore it, or delete it to have the tenant's backlog read in full") from e

    def untrained(self, tenant: str, limit: int | None = None) -> pa.Table:
        """Trajectories of `tenant` not yet trained, oldest first by ingested_at (TRAJECTORIES schema)."""
        check_tenant(tenant)

        def read() -> pa.Table:
            index, paths = self._untrained_index(tenant)
            if index.num_rows == 0:
                return TRAJECTORIES.empty_table()
            # Oldest first; a trajectory stored twice (in two files) counts once, at its first position.
            order = pc.sort_indices(
                index, sort_keys=[("ingested_at", "ascending"), ("file", "ascending"), ("row", "ascending")]
            )
            ranked = index.take(order).append_column("rank", pa.array(range(index.num_rows), pa.int64()))
            firsts = ranked.group_by("id", use_threads=False).aggregate([("rank", "min")]).column("rank_min")
            firsts = pc.take(firsts, pc.sort_indices(firsts))
            chosen = ranked.take(firsts if limit is None else firsts[:limit])
            # Read only the files that hold chosen rows, each once, then restore the order.
            by_file: dict[int, list[tuple[int, int]]] = {}
            for pos, (f, r) in enumerate(zip(chosen.column("file").to_pylist(), chosen.column("row").to_pylist())):
                by_file.setdefault(f, []).append((r, pos))
            parts = []
            for f, wanted in by_file.items():
                part = conform(read_rows(self.dd, paths[f], [r for r, _ in wanted]), TRAJECTORIES, strict=False,
                               what=paths[f])
                parts.append(part.append_column("_pos", pa.array([pos for _, pos in wanted], pa.int64())))
            merged = pa.concat_tables(parts)
            return merged.take(pc.sort_indices(merged.column("_pos"))).drop_columns(["_pos"])

        return retry_vanished(read, f"reading untrained trajectories of {tenant}")

    def backlog(self, include: Callable[[str], bool] | None = None) -> dict[str, int]:
        """tenant -> number of its trajectories not yet trained (distinct ids), for every tenant in storage or
        those `include` accepts (a learner shard asks for its own: the others' backlogs cost it nothing, and
        what it kept of a tenant it no longer asks for is let go). A tenant whose backlog cannot be read (an
        unreadable file, horizon.json) is left out, with the reason in `backlog_errors`: one tenant's bad file
        must not stop the others' training."""

        def read() -> dict[str, int]:
            out, errors = {}, {}
            for tenant in partition_tenants(self.dd, "trajectories"):
                try:
                    check_tenant(tenant)
                except StorageError:
                    continue
                if include is not None and not include(tenant):
                    self._backlogs.pop(tenant, None)
                    continue
                try:
                    self._untrained_index(tenant)
                except FileNotFoundError:
                    raise  # a file vanished (compaction): retry_vanished lists again
                except Exception as e:
                    errors[tenant] = f"{type(e).__name__}: {e}"
                    if self.backlog_errors.get(tenant) != errors[tenant]:
                        logger.error("backlog of %s cannot be read; left out until it can: %s", tenant, errors[tenant])
                    continue
                out[tenant] = self._backlogs[tenant].distinct
            self.backlog_errors = errors
            return out

        return retry_vanished(read, "computing backlog")

    def damaged_files(self) -> dict[str, list[str]]:
        """tenant -> its trajectories files that `backlog` found damaged (what is in them cannot be read), whose
        rows it leaves out, for those still listed at the last call."""
        return {tenant: sorted(state.damaged) for tenant, state in sorted(self._backlogs.items()) if state.damaged}

    # --- writing the cursor ---------------------------------------------------------------------------
    def commit(self, tenant: str, *, step: int, ids: list[str], checkpoint: Callable[[Path], None]) -> Path:
        """Records `ids` as trained at `step` together with `checkpoint(dir)`'s files; returns the checkpoint dir.

        After a crash at any point either both the ids and the checkpoint are visible or neither is.
        """
        check_tenant(tenant)
        step = int(step)
        if step < 0:
            raise CursorError(f"step must be >= 0, got {step}")
        tenant_dir = self.dd.tenant_cursors(tenant)
        with FileLock(self._lock_path(tenant)):
            last = self.latest_step(tenant)
            if last is not None and step <= last:
                raise CursorError(f"cannot commit step {step} for tenant {tenant!r}: step {last} is already committed")
            ensure_dir(tenant_dir)
            remove_stale_hidden(tenant_dir, older_than_s=0)  # we hold the lock: hidden entries are dead leftovers
            staging = tenant_dir / f".staging-{uuid.uuid4().hex}"
            (staging / "checkpoint").mkdir(parents=True)
            try:
                checkpoint(staging / "checkpoint")
                ids_table = pa.table({"id": pa.array(list(ids), pa.string())}, schema=_IDS_SCHEMA)
                pq.write_table(ids_table, staging / "ids.parquet")
                meta = {
                    "format": FORMAT,
                    "tenant": tenant,
                    "step": step,
                    "n_ids": len(ids),
                    "created_at": datetime.now(timezone.utc).isoformat(),
                }
                (staging / "commit.json").write_text(json.dumps(meta, indent=1))
                fsync_tree(staging)
                final = tenant_dir / _step_name(step)
                publish_dir(staging, final)  # the commit point
            finally:
                if staging.exists():
                    remove_tree(staging)
            try:  # housekeeping: the step is committed whatever happens here
                self._prune_checkpoints(tenant)
            except OSError as e:
                logger.warning("tenant %s: step %d committed, but pruning old checkpoints failed: %s", tenant, step, e)
        return final / "checkpoint"

    def make_durable(self, tenant: str) -> None:
        """fsyncs the tenant's cursor directory: its committed steps survive a power loss once this returns.
        `commit` does it too, at its commit point; what follows a commit that raised there (the rename done,
        its directory's fsync failed) must not rely on the step until this has succeeded."""
        fsync_dir(self.dd.tenant_cursors(check_tenant(tenant)))

    def forget(self, tenant: str, before_ms: int, *, dry_run: bool = False) -> int:
        """Retention: forgets the snapshots of the cursor's chain whose steps were all committed more than
        FORGET_MARGIN_MS before `before_ms`, and from then on leaves every trajectory ingested before
        `before_ms` out of the backlog; returns how many ids were (or would be) forgotten.

        Forgotten ids cost nothing any more (16 bytes each in every learner, and a cold start's read). It is
        safe: a row trained at a forgotten step was ingested before that step's commit, so before the
        cutoff, and the backlog leaves it out. The price is that a row ingested before the cutoff and not
        trained by then is never trained; retention deletes its file anyway. The horizon is written first
        (atomically: the commit point), then the forgotten snapshots are deleted; after a crash between the
        two, readers ignore them and the next `compact` or `forget` deletes them."""
        check_tenant(tenant)
        tenant_dir = self.dd.tenant_cursors(tenant)
        if not tenant_dir.is_dir():
            return 0
        if dry_run:  # no lock (it would create its file): a compaction may delete a snapshot it listed
            return retry_vanished(lambda: self._forget(tenant, before_ms, dry_run=True),
                                  f"counting what the cursor of {tenant} would forget")
        with FileLock(self._lock_path(tenant)):
            return self._forget(tenant, before_ms, dry_run=False)

    def _forget(self, tenant: str, before_ms: int, *, dry_run: bool) -> int:
        """`forget`'s work, under the tenant's cursor lock unless it is a dry run."""
        tenant_dir = self.dd.tenant_cursors(tenant)
        snapshots, steps = self._listing(tenant)
        old = self.horizon(tenant)
        chain = _chain(snapshots, old)
        gone = []
        for snap in chain:  # commit times grow along the chain: the old ones are a prefix
            if _newest_commit_ms(snap.path) >= before_ms - FORGET_MARGIN_MS:
                break
            gone.append(snap)
        if not gone:
            return 0
        ids = sum(_rows(snap.path) for snap in gone)
        if dry_run:
            return ids
        new = Horizon(gone[-1].last, before_ms if old.before_ms is None else max(before_ms, old.before_ms))
        atomic_write_bytes(tenant_dir / _HORIZON, json.dumps(
            {"format": FORMAT, "through": new.through, "before_ms": new.before_ms}).encode())
        self._remove_forgotten(tenant, new)
        logger.info("cursor of %s: forgot %d ids (steps <= %d; trajectories ingested before %s are left out)",
                    tenant, ids, new.through, datetime.fromtimestamp(new.before_ms / 1000, timezone.utc).isoformat())
        return ids

    def _remove_forgotten(self, tenant: str, horizon: Horizon) -> None:
        snapshots, steps = self._listing(tenant)
        for snap in snapshots:
            if snap.last <= horizon.through:
                snap.path.unlink(missing_ok=True)
        for s, path in steps:
            if s <= horizon.through and not (path / "checkpoint").exists():
                remove_tree(path)

    def compact(self, tenant: str) -> int:
        """Folds the per-step id files into the snapshot chain; returns how many step files it folded (0:
        nothing to do). Costs the steps it folds plus the merges the chain's sizes call for (see the module
        note), not a rewrite of every id trained so far."""
        check_tenant(tenant)
        tenant_dir = self.dd.tenant_cursors(tenant)
        with FileLock(self._lock_path(tenant)):
            snapshots, steps = self._listing(tenant)
            horizon = self.horizon(tenant)
            chain = _chain(snapshots, horizon)
            end = chain[-1].last if chain else horizon.through
            newer = [(s, p) for s, p in steps if s > end]
            if not newer or (len(newer) == 1 and not chain):
                self._remove_folded(tenant, chain)  # what an earlier fold replaced, once old enough
                return 0
            top = newer[-1][0]
            state = self._backlogs.get(tenant)
            if state is not None:  # read the steps about to be folded first: its next pass then reads no snapshot
                self._backlogs[tenant] = self._follow_cursor(state, snapshots, steps)
            folded = _Snapshot(end + 1, top, tenant_dir / _snapshot_name(end + 1, top))
            _write_ids(folded.path, [p / "ids.parquet" for _, p in newer], max(_step_commit_ms(p) for _, p in newer))
            chain.append(folded)
            chain = self._merge(tenant_dir, chain)
            self._remove_folded(tenant, chain)
            return len(newer)

    def _remove_folded(self, tenant: str, chain: list[_Snapshot]) -> None:
        """Deletes the snapshots and step files the chain holds, once the snapshot holding them is FOLD_GRACE_S
        old: a listing is read a piece at a time, and one that read past the new snapshot's name before it
        appeared and reached the names it replaced after they went would see neither (a learner starting then
        trained those ids again, for as long as it ran). What earlier crashes or older versions left goes too."""
        now_s = time.time()
        kept = {snap.path for snap in chain}
        snapshots, steps = self._listing(tenant)
        for snap in snapshots:
            if snap.path not in kept and _covered_long_enough(snap.first, snap.last, chain, now_s):
                snap.path.unlink(missing_ok=True)
        for s, path in steps:
            if not (path / "checkpoint").exists() and _covered_long_enough(s, s, chain, now_s):
                remove_tree(path)

    @staticmethod
    def _merge(tenant_dir: Path, chain: list[_Snapshot]) -> list[_Snapshot]:
        """The chain after the merges its snapshots' sizes and days call for (see the module note): each
        earlier day's run of snapshots becomes one, never merged again, and the newest day's run is a binary
        counter (the newest snapshot is merged with the one before while it holds at least as many ids)."""
        days = [_newest_commit_ms(snap.path) // DAY_MS for snap in chain]
        runs: list[list[_Snapshot]] = []
        for snap, day, previous in zip(chain, days, [None, *days]):
            if day == previous:
                runs[-1].append(snap)
            else:
                runs.append([snap])
        out: list[_Snapshot] = []
        for run in runs[:-1]:  # a closed day: its commits are all in
            out.append(_merged(tenant_dir, run) if len(run) > 1 else run[0])
        today = runs[-1]
        while len(today) > 1 and _rows(today[-1].path) >= _rows(today[-2].path):
            today[-2:] = [_merged(tenant_dir, today[-2:])]
        return out + today

    def set_aside_checkpoint(self, tenant: str, step: int) -> Path:
        """Moves step `step`'s damaged checkpoint out of the cursor, to `state/damaged-checkpoints/<tenant>/`,
        and returns where it went. The step stays committed (its ids stay); `latest_checkpoint` then finds the
        one before, if one is kept. Out of the cursor, the damaged one is not counted among the checkpoints
        kept (a commit would prune the sound one before it) nor taken for a leftover and deleted."""
        check_tenant(tenant)
        source = self.dd.tenant_cursors(tenant) / _step_name(int(step)) / "checkpoint"
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
        target = self.dd.damaged_checkpoints(tenant) / f"{_step_name(int(step))}-{stamp}"
        with FileLock(self._lock_path(tenant)):
            ensure_dir(target.parent)
            copied = False
            try:
                os.rename(source, target)
            except OSError as e:
                if e.errno != errno.EXDEV:
                    raise
                # state/ on another filesystem than cursors/: copied whole (and durable) under a hidden name,
                # then renamed into place; removed from the cursor once that is durable
                partial = target.with_name(f".{_step_name(int(step))}.partial")  # a crash's leftover: replaced
                remove_tree(partial)
                shutil.copytree(source, partial)
                fsync_tree(partial)
                os.rename(partial, target)
                copied = True
            fsync_dir(target.parent)  # its new entry durable before the old one's removal
            if copied:
                remove_tree(source)
            fsync_dir(source.parent)
            set_aside = [p for p in target.parent.iterdir() if not p.name.startswith(".")]
            by_time = sorted(set_aside, key=lambda p: p.name.rsplit("-", 1)[-1])  # step-<n>-<utc>
            for old in by_time[:-KEEP_DAMAGED]:
                remove_tree(old)
        return target

    # --- internals ------------------------------------------------------------------------------------
    def _lock_path(self, tenant: str) -> Path:
        return self.dd.locks / f"cursors-{tenant}.lock"

    def _steps(self, tenant: str) -> list[tuple[int, Path]]:
        return self._listing(tenant)[1]

    def _listing(self, tenant: str) -> tuple[list[_Snapshot], list[tuple[int, Path]]]:
        """(snapshots, step directories by number) of the tenant's cursor, from one read of the directory."""
        d = self.dd.tenant_cursors(tenant)
        try:
            names = os.listdir(d)
        except FileNotFoundError:
            return [], []
        snapshots = sorted(_Snapshot(int(m[1] or 0), int(m[2]), d / n) for n in names if (m := _SNAPSHOT.match(n)))
        steps = sorted((int(m[1]), d / n) for n in names if (m := _STEP_DIR.match(n)))
        return snapshots, steps

    def _trained(self, tenant: str) -> frozenset[str]:
        return frozenset(self._trained_array(tenant).to_pylist())

    def _trained_array(self, tenant: str) -> pa.Array:
        return retry_vanished(
            lambda: self._read_trained(self._trained_sources(tenant)), f"reading the cursor of {tenant}"
        )

    def _trained_sources(self, tenant: str) -> list[Path]:
        """The files that hold the cursor: the snapshot chain, then the ids of every later step. From one
        listing: a compaction running meanwhile writes a snapshot and then deletes the steps it covers, so a
        snapshot listed before it and steps listed after it would miss those steps' ids."""
        snapshots, steps = self._listing(tenant)
        horizon = self.horizon(tenant)
        chain = _chain(snapshots, horizon)
        end = chain[-1].last if chain else horizon.through
        return [snap.path for snap in chain] + [p / "ids.parquet" for s, p in steps if s > end]

    def _read_trained(self, sources: list[Path]) -> pa.Array:
        """Every id in `sources` (duplicates possible), read from disk: for `trained_ids` and `compact`, not
        for the backlog, which keeps fingerprints."""
        arrays = [pq.read_table(path, columns=["id"]).column("id").combine_chunks() for path in sources]
        return pa.concat_arrays(arrays) if arrays else pa.array([], pa.string())

    def _untrained_index(self, tenant: str) -> tuple[pa.Table, list[str]]:
        """(id, ingested_at, file, row) of every not yet trained trajectory of `tenant`, and the file paths
        that `file` indexes.

        Cheap when nothing moved (two directory listings); otherwise it costs what moved (see the module
        note). Each step below either completes or changes nothing it would have to redo, so a file that
        vanishes mid-way (retry_vanished lists again) leaves the tenant's state consistent.
        """
        paths = live_files(self.dd, "trajectories", tenant)
        snapshots, steps = self._listing(tenant)
        horizon = self.horizon(tenant)
        listing = (tuple(paths), tuple(snapshots), tuple(steps), horizon)
        state = self._backlogs.get(tenant)
        replaced = self._damaged_replaced(state) if state is not None else set()
        if state is not None and state.listing == listing and not replaced:
            return state.index, paths
        if state is None:
            state = _Backlog(horizon=horizon, through=horizon.through)
        elif state.horizon != horizon:  # retention moved it: the trained ids are read again, without the forgotten
            state = _moved(state, horizon)
        state = self._follow_cursor(state, snapshots, steps)
        self._backlogs[tenant] = state
        self._follow_files(state, paths, replaced)
        if state.pending.column("id").num_chunks > 16:
            state.pending = state.pending.combine_chunks()
        # `file` becomes the position in `paths`: untrained() reads paths[file] and orders ties by it.
        numbers = pa.array([state.files[p] for p in paths], pa.int32())
        position = pc.index_in(state.pending.column("file"), value_set=numbers).cast(pa.int32())
        state.index = state.pending.select(_ROWS_SCHEMA.names).set_column(2, _ROWS_SCHEMA.field("file"), position)
        state.distinct = pc.count_distinct(state.index.column("id")).as_py() if state.index.num_rows else 0
        state.listing = listing
        return state.index, paths

    def _follow_cursor(
        self, state: _Backlog, snapshots: list[_Snapshot], steps: list[tuple[int, Path]]
    ) -> _Backlog:
        """`state` with the ids of the listed cursor in `trained` and gone from `pending` (a new state when
        the cursor went back). Reads everything before changing anything."""
        chain = _chain(snapshots, state.horizon)
        top = chain[-1].last if chain else state.horizon.through
        newest = max([top, *(s for s, _ in steps)])
        if newest < state.through:  # the cursor went back (deleted by hand): start over
            state = _Backlog(horizon=state.horizon, through=state.horizon.through)
        # A snapshot reaching past what this instance has read may hold steps it never saw (folded and
        # deleted since its last call, or before its first): read it. Steps it read itself before they were
        # folded are not read again: then the snapshot ends at or before `through`.
        unseen = [snap for snap in chain if snap.last > state.through]
        read_to = max(state.through, unseen[-1].last if unseen else -1)
        sources = [snap.path for snap in unseen] + [p / "ids.parquet" for s, p in steps if s > read_to]
        # Added batch by batch, so a long history is never held twice. Adding before every source is read is
        # safe: the ids are trained, and `through` moves only at the end (a source that vanishes mid-way makes
        # the caller list again and come back here with the same `through`).
        added = False
        for path in sources:
            for ids in _id_batches(path):
                state.trained.add(*hash_strings(ids.to_pylist()))
                added = True
        if added and state.pending.num_rows:
            pending_hi, pending_lo = (state.pending.column(c).to_numpy() for c in ("hi", "lo"))
            state.pending = state.pending.filter(pa.array(~state.trained.contains(pending_hi, pending_lo)))
        state.through = max(state.through, newest)
        return state

    def _follow_files(self, state: _Backlog, paths: list[str], replaced: set[str]) -> None:
        """Drops the pending rows of files no longer listed; reads each newly listed file once and keeps its
        untrained rows. Paths key it because data files are never rewritten in place (only replaced by new
        names): a path that is still listed still holds what was read, but for a damaged one `replaced` names
        (restored in place, or gone), which is read again if listed."""
        live = set(paths)
        for path in [p for p in state.damaged if p in replaced or p not in live]:
            del state.damaged[path]
            live.discard(path)  # dropped from `files` below, then read as a new one if listed
        gone = [p for p in state.files if p not in live]
        if gone:
            numbers = pa.array([state.files.pop(p) for p in gone], pa.int32())
            state.pending = state.pending.filter(pc.invert(pc.is_in(state.pending.column("file"), value_set=numbers)))
        for path in paths:
            if path in state.files:
                continue
            try:
                cols = conform(read_file(self.dd, path, columns=["id", "ingested_at"]), _INDEX_SCHEMA, strict=False,
                               what=path)
            except FileNotFoundError:
                raise
            except (OSError, pa.ArrowException) as e:
                # A disk error or this process's trouble (an errno: EIO, EACCES, EMFILE...): tried again. Arrow's
                # errors for what is in the file carry none (a corrupt page is an OSError without one).
                if not damaged(e) or (isinstance(e, OSError) and e.errno is not None):
                    raise StorageError(f"cannot read {path}: {e}") from e
                # What is in it is damaged (torn, corrupt): it will never read, and compaction and retention
                # leave it alone, so failing on it stopped the tenant's training for good. Its rows are left out.
                logger.error("%s cannot be read (%s: %s); its trajectories are left out of training (restore the "
                             "file, or delete it)", path, type(e).__name__, e)
                cols = _INDEX_SCHEMA.empty_table()
                state.damaged[path] = self._signature(path)
            hi, lo = hash_strings(cols.column("id").to_pylist())
            untrained = ~state.trained.contains(hi, lo)
            if state.horizon.before_ms is not None:  # older than the horizon: left out (Cursors.forget)
                untrained &= cols.column("ingested_at").cast(pa.int64()).to_numpy() >= state.horizon.before_ms
            rows = np.flatnonzero(untrained)
            number = state.next_file
            if len(rows):
                new = cols.take(rows).append_column("file", pa.array(np.full(len(rows), number, np.int32)))
                new = new.append_column("row", pa.array(rows, pa.int64()))
                new = new.append_column("hi", pa.array(hi[rows])).append_column("lo", pa.array(lo[rows]))
                state.pending = pa.concat_tables([state.pending, new.cast(_PENDING_SCHEMA)])
            state.files[path] = number
            state.next_file += 1

    def _damaged_replaced(self, state: _Backlog) -> set[str]:
        """The damaged files whose (size, mtime) changed since they were found (restored in place, or gone)."""
        return {path for path, seen in state.damaged.items() if self._signature(path) != seen}

    def _signature(self, path: str) -> tuple:
        """A file's (size, mtime) as its filesystem says, to tell it was replaced; () when it cannot be looked at."""
        try:
            info = self.dd.filesystem.get_file_info(path)
        except OSError:
            return ()
        return info.size, info.mtime_ns

    def _prune_checkpoints(self, tenant: str) -> None:
        with_checkpoint = [p for _, p in self._steps(tenant) if (p / "checkpoint").exists()]
        for path in with_checkpoint[: max(0, len(with_checkpoint) - self.keep_checkpoints)]:
            remove_tree(path / "checkpoint")
