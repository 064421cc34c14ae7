"""Compaction: many small Parquet files per tenant partition become a few large ones, while others write.

Ingest writes a file per flush (about one a second per tenant), which makes reads slow after a day. For
each partition, compaction merges the small live files into `compacted-<time>-<uuid>.parquet`. The merged
file's footer lists every name it supersedes (its inputs, plus whatever its compacted inputs superseded),
and readers (parquet.live_files) skip superseded names. So:

  1. the merged file is written under a hidden name, fsynced, renamed in, the directory fsynced;
     -> from now on every clora reader reads the merged file and skips the inputs: no row twice, none lost;
  2. the inputs are deleted once the merged file is `grace_s` old (by default on a later run, 60 s on).
     -> a reader that listed the partition before (1) and is still reading finds its files in place; one
        slower than the grace period gets FileNotFoundError and lists again (parquet.retry_vanished).

Deferring the deletes (rather than deleting right after the rename) is what keeps long DuckDB queries
from failing mid-way when a compaction finishes under them; the price is superseded inputs lying on disk
for a while, invisible to clora readers. A crash between (1) and (2) leaves exactly that state too, and
the next run cleans it up. Writers are not disturbed: a file ingest writes during a run is simply not an
input, and a replay of an input's file id is recognised as superseded (see parquet.py). Inputs are
converted to the current schema on the way, so compaction also upgrades old files. It never downgrades
one: a file a newer clora wrote (during a rolling upgrade) may hold columns this version does not know, or a
newer schema version (schema.conform_loses); merging it would drop what this code cannot carry, for good
once the grace period deleted the input. Such a file is left out of the merge and logged at each run with
its partition and name; it stays live and readable, and a compactor of its version merges it.

Each merged file holds one UTC day: files of different days are never merged, the day of a file being that of
its newest `ingested_at` (from its footer's statistics, parquet.newest_ms). This is what bounds retention,
which deletes a whole file once its newest row is older than the cutoff: were days merged, a quiet partition's
merged file (under the target size) would be merged again at every run with whatever arrived, always hold a
recent row, and never be deleted. A closed day gets no new files (ingest dates a row when it stores it), so
its files are never merged again, and each goes once its newest row passes the cutoff: a row outlives the
retention by a day at most (plus an ingest flush's span for a file written across midnight, and the wait for
the next prune). The price: a partition keeps a file per day that had data, where it could have kept one. One
day's files are batched by size, in name order, and a batch's largest file is merged only once the others come
to half its size (`_worth_merging`: sizes grow by tiers, so a large file is not rewritten whole for a little
new data; a day keeps a file per tier). A file without rows has no day; it joins the newest day's files (it
adds no rows, so it dates nothing). A file compacted before this rule may span many days; it is dated by its
newest row like any other, and goes when that row is old. train_steps/ has no ingest time and is never pruned:
its files are batched by size alone.

Dating a file and checking its schema cost a footer read per candidate (a live file under two thirds of the
target, FINISHED_SHARE): the new files, which the merge reads whole anyway, and each kept day's merged files
still under that, which are candidates at every run (zstd makes a merged file smaller than its inputs, so a
busy day leaves many just under it). So each process keeps what it read of the last run's candidates (keyed by
name, size and mtime: a name is written once): a run of the `--every` loop reads the footers of new files
only; a one-off `clora compact` reads each candidate's once. A file whose footer cannot be read is left out,
logged and counted too (merging it would fail the run, and every later one); it stays live, and retention
reports it as well.

A compacted file whose footer cannot be read supersedes nothing and is read by no one
(parquet._SupersededIndex): the files it merged are live again while they are on disk. They, and every file no
newer than it (it may hold their rows), are left out of merges until it is restored or deleted, counted and
logged at each run: merged again, their rows would be in two live files once it can be read again, the new
merge not naming it.

Plain glob readers (DuckDB/Spark/pandas pointed at the tree, not `clora query`) do count the superseded
inputs twice until they are deleted; run `clora compact --grace 0` before handing the tree to such a tool.

The superseded-name lists are kept for ever: together, a partition's compacted files name every file ever
written there (~30 bytes a name, in the Parquet footer's key-value metadata only, not again in the Arrow
schema stored beside it). A name could be dropped only once no writer can write it again, and nothing
here can tell when that is. Ingest writes a name again when it replays the same offset ranges without
knowing their rows (its key indexes drop rows it knows, and fewer rows make another name):
the new owner of a partition whose previous owner's last write landed after the new owner loaded its view.
Committed offsets usually close that window within seconds, but nothing bounds it (the new owner may stall
for any time between loading and writing), and storage sees neither the consumer group's offsets, nor the
broker's retention, nor other callers of write_dataset. So the names are carried, and kept cheap instead:
each process reads a compacted file's footer once and holds its names as 128-bit hashes, 20 bytes a name
(parquet._SupersededIndex; 1.7 MB a day per dataset and tenant at a file a second), and a write's check
or a listing costs the files on disk and the footers new since the last one, not the partition's history.

One compactor per partition at a time (a non-blocking flock; a busy partition is skipped). `compact` also
folds each tenant's learner cursor into a snapshot (cursors.Cursors.compact). Not done here: deleting old
data (retention) or re-sorting rows.

Each partition and each cursor is a unit of its own: one that fails (a full disk, a file deleted by hand)
has its result carry the `error`, which the caller reports (`clora compact`: a line on stderr, exit 1), and
the others are compacted all the same; so is a dataset whose directory cannot be listed (a file in its
place, EACCES, EIO). The traceback is logged at DEBUG only: the error names what failed, and a traceback
per dataset buried that line (the `--every` loop printed them at every run). A partition's
run deletes what earlier runs merged before it merges anything, so on a full disk it still frees their
inputs. An input whose footer reads but whose rows do not (damaged pages) fails only its
own part: the batch is merged without it, and later runs of the process leave it out (remembered by name,
size and mtime, logged and counted each run) instead of failing on it again.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from storage.cursors import Cursors
from storage.files import FileLock, LockBusy, fsync_dir, remove_stale_hidden, write_new_file
from storage.layout import DATASETS, UNKNOWN_TENANT, as_datadir, check_dataset
from storage.parquet import (
    COMPACTED_PREFIX,
    ROW_GROUP_ROWS,
    SUPERSEDES_KEY,
    Listing,
    damaged,
    newest_in,
    partition_listing,
    parquet_options,
    partition_tenants,
    read_file,
    supersedes,
)
from storage.schema import INGESTED_AT, SCHEMAS, conform, conform_loses

logger = logging.getLogger(__name__)

TARGET_BYTES = 64 * 1024 * 1024  # a merge writes at most about this much
# Files of at least this share of the target are left alone: beside one larger, the other files of a batch
# (at most the target in all) could never come to half its size (`_worth_merging`), and it would be read
# as a candidate at every run for nothing.
FINISHED_SHARE = 2 / 3
STALE_TMP_S = 3600.0  # hidden temp files older than this belong to crashed writers
GRACE_S = 60.0  # superseded inputs are deleted once the file superseding them is this old
# The least time between a merged file's rename and its inputs' deletion, whatever grace_s says (0 included):
# a reader lists a partition by reading its directory, then looking at each entry, so one whose reading came
# before the rename and whose looks came after the deletion saw neither the inputs nor the merged file (rows
# missing from `clora query`, from the learner's backlog, from ingest's view of what is stored).
MIN_GRACE_S = 2.0
DAY_MS = 86_400_000


@dataclass
class CompactionResult:
    dataset: str
    tenant: str  # "": the whole dataset (its tenants could not be listed)
    inputs: int = 0  # files merged by this run
    rows: int = 0
    outputs: list[str] = field(default_factory=list)
    removed: int = 0  # superseded files (of this or earlier runs) and stale temp files deleted
    waiting: int = 0  # superseded files kept until their grace period is over
    left_out: int = 0  # live files this run would not merge (logged with their reason)
    skipped: str | None = None
    error: str | None = None  # why the run failed here (its traceback logged at DEBUG); the others went on

    @property
    def where(self) -> str:
        return f"{self.dataset}/tenant={self.tenant}" if self.tenant else self.dataset

    def __str__(self) -> str:
        where = self.where
        if self.skipped:
            return f"{where}: skipped ({self.skipped})"
        if self.error and not (self.inputs or self.removed or self.waiting or self.left_out):
            return f"{where}: failed: {self.error}"
        left_out = f"; {self.left_out} files left out (see the log)" if self.left_out else ""
        failed = f"; then failed: {self.error}" if self.error else ""
        return (
            f"{where}: {self.inputs} files -> {len(self.outputs)} ({self.rows} rows); "
            f"{self.removed} superseded files deleted, {self.waiting} waiting for the grace period{left_out}{failed}"
        )


def compact(
    root,
    dataset: str | None = None,
    tenant: str | None = None,
    *,
    target_bytes: int = TARGET_BYTES,
    min_files: int = 2,
    grace_s: float = GRACE_S,
) -> list[CompactionResult]:
    """Compacts every partition (of one dataset / one tenant if given) and the learner cursors. A partition or
    cursor that fails (a full disk, a file that will not read) has its `error` set in the results (a cursor
    as dataset "cursors"), for the caller to report; the others are compacted all the same. So is a dataset
    (or the cursors) whose tenants cannot be listed (a file in the directory's place, EACCES, EIO): its
    result has the tenant "". Tracebacks are logged at DEBUG only (see the module note)."""
    dd = as_datadir(root)
    results = []
    for ds in [check_dataset(dataset)] if dataset else DATASETS:
        try:
            tenants = [tenant] if tenant else partition_tenants(dd, ds)
        except OSError as e:  # one dataset's directory must not stop the others' compaction
            logger.debug("listing the tenants of %s failed", ds, exc_info=True)
            results.append(CompactionResult(ds, "", error=f"{type(e).__name__}: {e}"))
            continue
        for t in tenants:
            results.append(
                compact_partition(dd, ds, t, target_bytes=target_bytes, min_files=min_files, grace_s=grace_s)
            )
    _remove_at_floor(dd, results, grace_s)
    if dataset is None and tenant != UNKNOWN_TENANT:  # dead letters without a tenant have no learner cursor
        cursors = Cursors(dd)
        try:
            tenants = [tenant] if tenant else cursors.tenants()
        except OSError as e:
            logger.debug("listing the tenants of the cursors failed", exc_info=True)
            results.append(CompactionResult("cursors", "", error=f"{type(e).__name__}: {e}"))
            tenants = []
        for t in tenants:
            try:
                folded = cursors.compact(t)
            except Exception as e:  # noqa: BLE001 (one tenant's cursor must not stop the others' folding)
                logger.debug("folding the cursor of %s failed", t, exc_info=True)
                results.append(CompactionResult("cursors", t, error=f"{type(e).__name__}: {e}"))
                continue
            if folded:
                logger.info("cursor of %s: folded %d step files into a snapshot", t, folded)
    return results


def _remove_at_floor(dd, results: list[CompactionResult], grace_s: float) -> None:
    """With a grace period under MIN_GRACE_S, this run's inputs are deleted at its end, MIN_GRACE_S after the
    last merge (once for the whole run), so that `clora compact --grace 0` still returns with them gone."""
    merged = [r for r in results if r.outputs and not r.error and r.waiting]
    if grace_s >= MIN_GRACE_S or not merged:
        return
    time.sleep(MIN_GRACE_S)
    for result in merged:
        try:
            with partition_lock(dd, result.dataset, result.tenant):
                removed, result.waiting = _remove_superseded(dd, result.dataset, result.tenant, grace_s)
                result.removed += removed
        except LockBusy:  # another compaction of it now: that one deletes them
            pass
        except Exception as e:  # noqa: BLE001 (as compact_partition: reported, the others go on)
            logger.debug("deleting the inputs of %s/tenant=%s failed", result.dataset, result.tenant, exc_info=True)
            result.error = f"{type(e).__name__}: {e}"


def partition_lock(dd, dataset: str, tenant: str):
    """The lock of one partition's compaction (non-blocking: LockBusy when held); retention takes it too."""
    return FileLock(dd.locks / f"compact-{dataset}-{tenant}.lock", blocking=False)


def compact_partition(
    root,
    dataset: str,
    tenant: str,
    *,
    target_bytes: int = TARGET_BYTES,
    min_files: int = 2,
    grace_s: float = GRACE_S,
) -> CompactionResult:
    """Merges one partition's small files and deletes what earlier runs merged once its grace is over. A
    failure is set as the result's `error` for the caller to report (its traceback logged at DEBUG), not
    raised: what was done before it stands."""
    dd = as_datadir(root)
    result = CompactionResult(dataset, tenant)
    directory = dd.partition(dataset, tenant)
    try:
        with partition_lock(dd, dataset, tenant):
            # Deleting first: a run that cannot write (a full disk) still frees what earlier runs merged.
            result.removed, result.waiting = _remove_superseded(dd, dataset, tenant, grace_s)
            result.removed += remove_stale_hidden(directory, older_than_s=STALE_TMP_S)
            listing = partition_listing(dd, dataset, tenant)
            finished = target_bytes * FINISHED_SHARE
            candidates = _not_in_unreadable(listing, [i for i in listing.live() if i.size < finished], result)
            for day in _groups(dd, dataset, tenant, candidates, result):
                for batch in _batches(day, target_bytes):
                    _merge_batch(dd, dataset, directory, _worth_merging(batch), min_files, result)
            if result.outputs:  # this run's inputs, due now with no grace
                removed, result.waiting = _remove_superseded(dd, dataset, tenant, grace_s)
                result.removed += removed
    except LockBusy:
        result.skipped = "another compaction holds this partition"
    except Exception as e:  # noqa: BLE001 (one partition's failure must not stop the others' compaction)
        logger.debug("compaction of %s/tenant=%s failed", dataset, tenant, exc_info=True)
        result.error = f"{type(e).__name__}: {e}"
    logger.debug("%s", result)  # the caller reports it (`clora compact` prints each result that did something)
    return result


def _merge_batch(dd, dataset: str, directory: Path, batch: list, min_files: int, result: CompactionResult) -> None:
    """Merges `batch` if it holds at least `min_files`. An input whose rows cannot be read (damaged past its
    footer) is remembered and left out, and the rest merged without it: were it kept, the same batch would
    fail at every later run and the partition never be compacted again."""
    while len(batch) >= min_files:
        try:
            name, rows = _merge(dd, dataset, directory, batch)
        except _InputUnreadable as e:
            logger.warning("compaction of %s/tenant=%s: %s is unreadable, left out: %s",
                           result.dataset, result.tenant, e.info.base_name, e.reason)
            _unreadable.setdefault(str(directory), {})[file_key(e.info)] = e.reason
            result.left_out += 1
            batch = [i for i in batch if i is not e.info]
            continue
        result.inputs += len(batch)
        result.rows += rows
        result.outputs.append(name)
        return


# ---------------------------------------------------------------------------------------------------------
# Which files may be merged together


@dataclass(frozen=True)
class _Footer:
    """What a candidate's footer says about merging it."""

    day: int | None  # UTC day (since the epoch) of its newest ingested_at; None: no rows, or not dated
    left_out: str | None  # why it must not be merged (schema.conform_loses), or None


# partition directory -> {(name, size, mtime_ns): _Footer} for the candidates of its last run (see the module
# note). Runs on one partition never overlap (its lock is taken per call, even within a process), and a run
# replaces its partition's entry whole.
_footers: dict[str, dict[tuple[str, int, int], _Footer]] = {}
# partition directory -> {(name, size, mtime_ns): why} for the candidates whose rows a merge could not read
# (_merge_batch); kept, like _footers, for the candidates of the last run.
_unreadable: dict[str, dict[tuple[str, int, int], str]] = {}


def file_key(info) -> tuple[str, int, int]:
    """What tells a file apart from another of its name once read: (name, size, mtime_ns); a name is written
    once, so a file of that name that is not the one read differs in size or time."""
    return info.base_name, info.size, info.mtime_ns


class _InputUnreadable(Exception):
    """A merge's input whose rows could not be read."""

    def __init__(self, info, cause: Exception):
        super().__init__(info.path)
        self.info, self.reason = info, f"{type(cause).__name__}: {cause}"


def _groups(dd, dataset: str, tenant: str, infos: list, result: CompactionResult) -> list[list]:
    """`infos` (live files under the target, in name order) in the groups that may be merged: one per UTC
    day, oldest first, files without rows in the newest (train_steps, undated: one group). A file that
    must not be merged, or whose footer cannot be read, is in none: logged and counted instead."""
    directory = str(dd.partition(dataset, tenant))
    known = _footers.get(directory, {})
    known_bad = _unreadable.get(directory, {})
    footers: dict[tuple[str, int, int], _Footer] = {}
    bad: dict[tuple[str, int, int], str] = {}
    days: dict[int | None, list] = {}
    for info in infos:
        key = file_key(info)
        if key in known_bad:
            bad[key] = known_bad[key]
            logger.warning("compaction of %s/tenant=%s: %s is unreadable, left out: %s",
                           dataset, tenant, info.base_name, bad[key])
            result.left_out += 1
            continue
        try:
            footer = footers[key] = known[key] if key in known else _footer_of(dd, dataset, info)
        except FileNotFoundError:  # deleted by hand meanwhile (clora deletes only under this lock)
            continue
        except Exception as e:  # noqa: BLE001 (one bad file must not stop the partition's compaction)
            logger.warning("compaction of %s/tenant=%s: %s is unreadable, left out: %s: %s",
                           dataset, tenant, info.base_name, type(e).__name__, e)
            result.left_out += 1
            continue
        if footer.left_out:
            logger.warning("compaction of %s/tenant=%s: %s left out of the merge (it stays live and readable): %s",
                           dataset, tenant, info.base_name, footer.left_out)
            result.left_out += 1
            continue
        days.setdefault(footer.day, []).append(info)
    _footers[directory] = footers
    _unreadable[directory] = bad
    undated = days.pop(None, [])
    groups = [days[d] for d in sorted(days)]
    if undated and groups:
        groups[-1] = sorted(groups[-1] + undated, key=lambda i: i.base_name)
    elif undated:
        groups = [undated]
    return groups


def _not_in_unreadable(listing: Listing, infos: list, result: CompactionResult) -> list:
    """`infos`, or none of them while a compacted file of the partition cannot be read: it may have merged
    any of them (its inputs' times say nothing once it is restored with other times, or the clock moved).
    Readers read those in its place; merged again, their rows would be read twice once it is restored, since
    the new merge would not name it. The partition's files are counted as left out and logged at every run;
    deleting what is superseded goes on."""
    if not listing.unreadable:
        return infos
    logger.warning(
        "compaction of %s/tenant=%s: %s cannot be read, so nothing of the partition is merged (it may hold any "
        "file's rows). Restore it, or delete it if the rows only it holds are not needed",
        result.dataset, result.tenant, ", ".join(sorted(listing.unreadable)),
    )
    result.left_out += len(listing.unreadable) + len(infos)
    return []


def _footer_of(dd, dataset: str, info) -> _Footer:
    schema = SCHEMAS[dataset]
    with dd.filesystem.open_input_file(info.path) as f:
        pf = pq.ParquetFile(f)
        left_out = conform_loses(pf.schema_arrow, schema)
        if left_out or schema.get_field_index(INGESTED_AT) < 0:  # train_steps: never pruned, so not dated
            return _Footer(None, left_out)
        newest, _ = newest_in(pf, INGESTED_AT, info.path)
    return _Footer(None if newest is None else newest // DAY_MS, None)


def _worth_merging(batch: list) -> list:
    """`batch` (in name order) less its largest files for as long as the others come to under half the
    largest's size. Merged with a little new data, a large file is rewritten whole for little: a busy day's
    merged file, and train_steps' (undated, so never closed), were rewritten at every run, a partition's
    history a run. Left as it is, it is merged once the files beside it come to half its size: sizes grow
    by tiers, a row is rewritten about log2(target / a flush's size) times, and a day keeps a file per tier."""
    files = sorted(batch, key=lambda i: i.size)
    others = sum(i.size for i in files[:-1])
    while len(files) > 1 and 2 * others < files[-1].size:
        files.pop()
        others -= files[-1].size
    return sorted(files, key=lambda i: i.base_name)


def _batches(infos: list, target_bytes: int) -> list[list]:
    """Groups small files (in name order) into runs of about target_bytes."""
    batches, current, size = [], [], 0
    for info in infos:
        if current and size + info.size > target_bytes:
            batches.append(current)
            current, size = [], 0
        current.append(info)
        size += info.size
    if current:
        batches.append(current)
    return batches


# ---------------------------------------------------------------------------------------------------------
# Merging and deleting


def _merge(dd, dataset: str, directory: Path, batch: list) -> tuple[str, int]:
    """Writes the merged file; from the moment it is renamed in, it (not the batch) is what readers read."""
    schema = SCHEMAS[dataset]
    names = set()
    tables = []
    for info in batch:
        names.add(info.base_name)
        if info.base_name.startswith(COMPACTED_PREFIX):
            names.update(supersedes(dd, info))  # transitive: a replay of those stays a no-op
        try:
            table = read_file(dd, info.path)
        except Exception as e:
            # Deleted by hand meanwhile (clora deletes only under the partition's lock), or this process's
            # trouble (memory, open files): the run fails. The input's own damage: _merge_batch leaves it out.
            if isinstance(e, FileNotFoundError) or not damaged(e):
                raise
            raise _InputUnreadable(info, e) from e
        # Not strict: an old file lacks the columns added since (nulls); _groups kept out any it would drop.
        tables.append(conform(table, schema, strict=False))
    merged = pa.concat_tables(tables).replace_schema_metadata(schema.metadata)
    now_ns = time.time_ns()  # names sort by creation time (parquet._SupersededIndex relies on it)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now_ns // 10**9)) + f".{now_ns % 10**9:09d}"
    name = f"{COMPACTED_PREFIX}{stamp}-{uuid.uuid4().hex[:8]}.parquet"

    def write(tmp: Path) -> None:
        with pq.ParquetWriter(tmp, merged.schema, **parquet_options(merged.schema)) as writer:
            writer.write_table(merged, row_group_size=ROW_GROUP_ROWS)
            # In the Parquet footer's key-value metadata only: put in the table's schema metadata, the list
            # was written twice, once more inside the serialized Arrow schema (base64), and every reader of the
            # footer parsed both.
            writer.add_key_value_metadata({SUPERSEDES_KEY: json.dumps(sorted(names)).encode()})

    write_new_file(directory / name, write)
    logger.debug("%s: merged %d files (%d rows) into %s", directory, len(batch), merged.num_rows, name)
    return name, merged.num_rows


def _remove_superseded(dd, dataset: str, tenant: str, grace_s: float) -> tuple[int, int]:
    """Deletes files that have been superseded for at least grace_s; returns (deleted, kept for now).

    "Superseded since" is the time the *first* compacted file naming it appeared (later merges name it
    again, and must not push its deletion back for ever)."""
    listing = partition_listing(dd, dataset, tenant)
    superseded = listing.superseded
    now_ns = time.time_ns()
    doomed = [i for i in listing.on_disk if i.base_name in superseded]
    grace_s = max(grace_s, MIN_GRACE_S)
    due = [i for i in doomed if (now_ns - superseded[i.base_name].since_ns) / 1e9 >= grace_s]
    for info in due:
        Path(info.path).unlink(missing_ok=True)
    if due:
        fsync_dir(dd.partition(dataset, tenant))
    return len(due), len(doomed) - len(due)
