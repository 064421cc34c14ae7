"""Writing and reading the hive-partitioned Parquet datasets: `<root>/<dataset>/tenant=<t>/<file_id>.parquet`.

Writes are idempotent by file id: the writer (ingest) derives `file_id` from what it consumed (topic,
partition, offset range), so a batch replayed after a crash lands on the same name and is a no-op. Each
file appears atomically (files.write_new_file) with the schema version in its footer.

Compaction (compact.py) replaces many small files by one `compacted-*.parquet` whose footer lists the
names it supersedes. Which files a reader must read is therefore decided here, in `live_files`: every
`*.parquet` in the partition minus every name some compacted file there supersedes. That one rule gives:
  - no double counting while superseded inputs still lie on disk (compaction deletes them only after a
    grace period, and a crash may leave them behind);
  - write idempotency across compaction: a replayed file id that a compacted file supersedes would be
    ignored by readers even if written again, and write_dataset does not write it.
A reader whose file vanishes between listing and opening (compaction deleted it) lists again. Each process
keeps what a partition's compacted files supersede as hashes, reading each footer once (_SupersededIndex),
so a write's check and a listing cost the files on disk, not every name the partition ever had. A compacted
file whose footer cannot be read supersedes nothing and is itself left out (logged; `unreadable_files`):
the files it merged are read in its place while they are on disk, and one damaged file stops no reader or
writer of the dataset.

Plain Parquet readers that glob the tree (DuckDB, Spark, pandas) count superseded inputs twice until
compaction deletes them; `clora query` and every clora reader use `live_files` and never do.

This module knows nothing of what the rows mean; schemas live in schema.py.
"""

from __future__ import annotations

import bisect
import errno
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from storage.files import fsync_dir, write_new_file
from storage.hashindex import ABSENT, HashIndex, hash_strings
from storage.layout import (
    FILE_ID,
    UNKNOWN_TENANT,
    DataDir,
    InvalidName,
    StorageError,
    as_datadir,
    check_dataset,
    check_tenant,
)
from storage.schema import SCHEMAS, SchemaMismatch, conform

logger = logging.getLogger(__name__)

__all__ = [
    "SchemaMismatch",
    "live_files",
    "partition_tenants",
    "read_dataset",
    "read_ids",
    "write_dataset",
]

PARQUET_SUFFIX = ".parquet"
COMPACTED_PREFIX = "compacted-"
SUPERSEDES_KEY = b"clora.supersedes"
COMPRESSION = "zstd"  # compacted files: written once, read many times; the smallest
FRESH_COMPRESSION = "snappy"  # ingest's files, on the hot path: ~2x faster to write than zstd, ~1.4x larger
# (compaction rewrites them as zstd)
ROW_GROUP_ROWS = 16384  # compacted files: small enough that a batch read touches little of a large file
# Dictionary-encoded columns: few distinct values per file. Dictionary-encoding ids, texts and token lists
# (pyarrow's default: every column) costs write time and saves nothing.
DICTIONARY_COLUMNS = frozenset({"tenant", "adapter_version", "reward_source", "source", "reason", "kafka_topic", "mode", "version"})
READ_ATTEMPTS = 8
UNREADABLE_RETRY_S = 60.0  # a compacted file whose footer could not be read is read again after this long

T = TypeVar("T")


# ---------------------------------------------------------------------------------------------------------
# Writing


def write_dataset(root, dataset: str, table: pa.Table, *, file_id: str) -> list[Path]:
    """Writes `table` as one file per tenant: <root>/<dataset>/tenant=<t>/<file_id>.parquet.

    Casts to SCHEMAS[dataset] (SchemaMismatch names the column). A file that already exists, or that a
    compacted file already supersedes, is not written again. Returns, per tenant, the path that holds the
    rows: the new (or existing) file, or the compacted file that absorbed it.
    """
    dd = as_datadir(root)
    schema = SCHEMAS[check_dataset(dataset)]
    if not isinstance(file_id, str) or not FILE_ID.match(file_id) or file_id.startswith(COMPACTED_PREFIX):
        raise InvalidName(
            f"file_id {file_id!r} must match {FILE_ID.pattern} and not start with {COMPACTED_PREFIX!r}"
        )
    table = conform(table, schema, strict=True, what=f"{dataset} table")
    if table.num_rows == 0:
        return []
    paths = []
    for tenant, rows in split_by_tenant(table):
        check_tenant(tenant, allow_unknown=dataset == "dead_letters")
        paths.append(_write_partition_file(dd, dataset, tenant, file_id, rows))
    return paths


def split_by_tenant(table: pa.Table) -> list[tuple[str, pa.Table]]:
    """(tenant, its rows in their original order) per tenant, tenants sorted: one stable sort and slices,
    not a filter pass per tenant. A table already ordered by tenant (ingest sorts its rows before building
    the table) is only sliced: the sort would copy every column for nothing."""
    if table.num_rows == 0:
        return []
    runs = _tenant_runs(table)
    values = runs.values.to_pylist()
    if values != sorted(set(values)):
        table = table.take(pc.sort_indices(table, sort_keys=[("tenant", "ascending")]))  # stable
        runs = _tenant_runs(table)
        values = runs.values.to_pylist()
    ends = runs.run_ends.to_pylist()
    out, start = [], 0
    for tenant, end in zip(values, ends):
        out.append((tenant, table.slice(start, end - start)))
        start = end
    return out


def _tenant_runs(table: pa.Table) -> pa.RunEndEncodedArray:
    tenants = table.column("tenant")
    return pc.run_end_encode(tenants.combine_chunks() if tenants.num_chunks != 1 else tenants.chunk(0))


def parquet_options(schema: pa.Schema, compression: str = COMPRESSION) -> dict:
    """pq.write_table keyword arguments for a clora dataset file."""
    return {"compression": compression, "use_dictionary": [n for n in schema.names if n in DICTIONARY_COLUMNS]}


def _write_partition_file(dd: DataDir, dataset: str, tenant: str, file_id: str, rows: pa.Table) -> Path:
    directory = dd.partition(dataset, tenant)
    name = file_id + PARQUET_SUFFIX
    final = directory / name
    if final.exists():
        fsync_dir(directory)  # a replay after a crash between its link and the directory's fsync
        return final
    absorbed = retry_vanished(lambda: _superseded(dd, directory, name), f"checking {final}")
    if absorbed is not None:
        logger.debug("%s was already compacted into %s; not rewriting it", final, absorbed.by)
        return directory / absorbed.by
    write_new_file(final, lambda tmp: pq.write_table(rows, tmp, **parquet_options(rows.schema, FRESH_COMPRESSION)))
    return final


# ---------------------------------------------------------------------------------------------------------
# Which files to read


@dataclass(frozen=True)
class Superseded:
    """A file on disk that a compacted file in its partition supersedes."""

    by: str  # the newest compacted file naming it: the live file that holds its rows now
    since_ns: int  # mtime of the first compacted file seen naming it (compact.py's grace period counts from it)


def supersedes(dd: DataDir, info: pafs.FileInfo) -> tuple[str, ...]:
    """The names a compacted file supersedes, read from its footer (not cached: see _SupersededIndex)."""
    return read_supersedes(dd.filesystem, info.path)


def read_supersedes(fs: pafs.FileSystem, path: str) -> tuple[str, ...]:
    with fs.open_input_file(path) as f:
        meta = pq.read_metadata(f).metadata or {}
    names = json.loads(meta.get(SUPERSEDES_KEY, b"[]"))
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{path}: {SUPERSEDES_KEY.decode()} in the footer is not a list of file names")
    return tuple(names)


def damaged(e: BaseException) -> bool:
    """Whether reading a file failed on what is in it (truncated or corrupt: Arrow's own errors, which carry
    no errno, or a footer that is not what clora writes) or on a failing disk (EIO); not on this process's
    state (memory, open files, permissions), which passes and must not mark a good file as bad."""
    if isinstance(e, MemoryError):
        return False
    if isinstance(e, OSError):
        return e.errno in (None, errno.EIO)
    return isinstance(e, (pa.ArrowException, ValueError))


class _SupersededIndex:
    """What the compacted files of one partition supersede, kept up to date as they come and go.

    A listing (or a write's check) costs the files on disk plus the footers of compacted files new since the
    last one: each footer is read once per process. Its names are kept as 128-bit hashes with the number of
    the newest compacted file naming each (a hashindex.HashIndex: 20 bytes per name, where Python strings
    took ~110), so adding a footer costs its own names (amortised), not the partition's history. Newest,
    because a merge of a compacted file carries what that file superseded: the newest file naming a name
    holds its rows now (compacted names sort by creation time, and `update` rebuilds from the footers if one
    arrives out of that order). A compacted file that disappears (retention's deletes; compaction never
    deletes one) takes the names it was the newest to name with it, or leaves them to an older file still
    naming them (`_forget`).

    `on_disk` keeps, for the files of the last listing, whether and since when they are superseded; a
    listing updates it from the footers it adds and looks up only files it has not seen before.

    A compacted file whose footer cannot be read (truncated, damaged by a bad copy or restore, unreadable
    on a failing disk) supersedes nothing here: the files it merged are live while they are on disk (they
    hold its rows), and it is in `unreadable`, which readers leave out (reading it would fail every read of
    the dataset). It is logged once and remembered by (name, size, mtime) so that each listing does not read
    it again; it is tried again every UNREADABLE_RETRY_S (an error of the file system may pass) and at once
    if it changes (restored). Only its rows that are nowhere else are missing meanwhile.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # compacted file -> (size, mtime_ns, monotonic time to try it again): kept across a reset
        self._unreadable: dict[str, tuple[int, int, float]] = {}
        self.unreadable: frozenset[str] = frozenset()  # compacted files on disk that the last update could not read
        self._reset()

    def _reset(self) -> None:
        self._names = HashIndex(values=True)  # name -> number of the newest compacted file naming it
        self._number: dict[str, tuple[int, int]] = {}  # compacted file on disk -> (size, its number)
        self._files: list[tuple[str, int]] = []  # number -> (compacted file, mtime_ns); reused once free
        self._owned: list[int] = []  # number -> how many names it is the newest to supersede
        self._free: list[int] = []
        self._newest = ""  # the newest compacted file added
        self.on_disk: dict[str, Superseded | None] = {}

    @property
    def names(self) -> int:
        return len(self._names)

    def update(self, dd: DataDir, infos: list[pafs.FileInfo]) -> None:
        """Brings the index to the listing `infos` (every data file of the partition)."""
        compacted = {i.base_name: i for i in infos if i.base_name.startswith(COMPACTED_PREFIX)}
        for name in [n for n in self._unreadable if n not in compacted]:
            del self._unreadable[name]
        now = time.monotonic()
        new = sorted(n for n in compacted if (n not in self._number or self._number[n][0] != compacted[n].size)
                     and not self._still_unreadable(compacted[n], now))
        footers, lost = {}, False
        for n in new:
            names = self._footer(dd, compacted[n])
            if names is not None:
                footers[n] = names
            else:
                lost = lost or n in self._number  # replaced by a file that cannot be read: it names nothing now
        if lost or (footers and min(footers) <= self._newest):
            # Out of order (a clock set back, a file replaced) or one gone bad: start again from the footers.
            self._reset()
            for n in compacted:
                if n not in footers and not self._still_unreadable(compacted[n], now):
                    names = self._footer(dd, compacted[n])
                    if names is not None:
                        footers[n] = names
        listed = {i.base_name for i in infos}
        for name in sorted(footers):
            self._add(compacted[name], footers[name], listed)
        self.unreadable = frozenset(n for n in compacted if n in self._unreadable)
        gone = [n for n in self._number if n not in compacted]
        if gone:
            numbers = {self._number[n][1] for n in gone}
            owners = any(self._owned[k] for k in numbers) or any(s and s.by in gone for s in self.on_disk.values())
            try:
                forgotten = not owners or self._forget(dd, gone, compacted)
            except BaseException:  # half done (a footer vanished meanwhile): the next update rebuilds
                self._reset()
                raise
            if not forgotten:
                self._reset()
                return self.update(dd, infos)
            for n in gone:
                del self._number[n]
            self._free.extend(numbers)
        self.on_disk = {n: self.on_disk[n] for n in listed if n in self.on_disk}
        unseen = [n for n in listed if n not in self.on_disk]
        for name, status in zip(unseen, self._lookup(unseen)):
            self.on_disk[name] = status

    def _forget(self, dd: DataDir, gone: list[str], compacted: dict[str, pafs.FileInfo]) -> bool:
        """Drops the names the `gone` compacted files were the newest to name (retention deletes a day's
        files; compaction never deletes one); a name another file still on disk names goes to the newest of
        those. Only files older than the newest gone one can name such a name (a newer one would own it), so
        only their footers are read again: retention deletes the oldest, so usually none. (Rebuilding from
        every footer, as before, held a busy partition's writers for seconds to minutes after each prune.)
        False when a footer cannot be read now: the caller rebuilds from them all."""
        numbers = [self._number[n][1] for n in gone]
        self._names.remove_values(numbers)
        for k in numbers:
            self._owned[k] = 0
        newest_gone = max(gone)
        older = sorted(n for n in self._number if n < newest_gone and n not in gone and n in compacted)
        # Files on disk superseded by a gone file: looked up again, or given to the older files as they are read.
        affected = {n for n, s in self.on_disk.items() if s is not None and s.by in gone}
        self.on_disk = {n: s for n, s in self.on_disk.items() if n not in affected}
        again: list[int] = []  # the numbers of the older files re-read so far (older than the one being read)
        for name in older:
            names = self._footer(dd, compacted[name])
            if names is None:
                return False
            number = self._number[name][1]
            h1, h2 = hash_strings(names)
            owners = self._names.find(h1, h2)
            # Absent: owned by a gone file. Owned by an older file re-read before: that one named it too.
            take = (owners == ABSENT) | np.isin(owners, again)
            before = self._names.assign(h1[take], h2[take], number)
            for k, count in zip(*np.unique(before[before != ABSENT], return_counts=True)):
                self._owned[int(k)] -= int(count)
            self._owned[number] += int(take.sum())
            again.append(number)
            mtime = compacted[name].mtime_ns
            for listed in affected.intersection(names):  # as `_add` does
                before = self.on_disk.get(listed)
                self.on_disk[listed] = Superseded(name, mtime if before is None else min(before.since_ns, mtime))
        if self._newest in gone:
            self._newest = max((n for n in self._number if n not in gone), default="")
        return True

    def superseded(self, name: str) -> Superseded | None:
        """Whether (and by which compacted file) `name` is superseded, as of the last `update`."""
        if name in self.on_disk:
            return self.on_disk[name]
        return self._lookup([name])[0]

    def _lookup(self, names: list[str]) -> list[Superseded | None]:
        if not names or not self.names:
            return [None] * len(names)
        owners = self._names.find(*hash_strings(names))
        return [None if k == ABSENT else Superseded(*self._files[k]) for k in owners.tolist()]

    def _still_unreadable(self, info: pafs.FileInfo, now: float) -> bool:
        """Whether `info` is a compacted file that could not be read, unchanged since, not yet due again."""
        known = self._unreadable.get(info.base_name)
        return known is not None and known[:2] == (info.size, info.mtime_ns) and now < known[2]

    def _footer(self, dd: DataDir, info: pafs.FileInfo) -> tuple[str, ...] | None:
        """The names a compacted file supersedes; None, remembered and logged once, when its footer cannot
        be read. A file that vanished raises FileNotFoundError (retry_vanished lists again)."""
        try:
            names = read_supersedes(dd.filesystem, info.path)
        except Exception as e:
            if isinstance(e, FileNotFoundError) or not damaged(e):
                raise  # vanished (listed again), or this process's trouble rather than the file's
            known = self._unreadable.get(info.base_name)
            if known is None or known[:2] != (info.size, info.mtime_ns):
                logger.warning(
                    "%s cannot be read (%s: %s): it is left out of every read, and the files it merged are "
                    "read in its place while they are on disk; rows held only by it are missing until it is "
                    "restored (compaction merges nothing of its partition meanwhile)",
                    info.path, type(e).__name__, e,
                )
            self._unreadable[info.base_name] = (info.size, info.mtime_ns, time.monotonic() + UNREADABLE_RETRY_S)
            return None
        if self._unreadable.pop(info.base_name, None) is not None:
            logger.info("%s can be read again", info.path)
        return names

    def _add(self, info: pafs.FileInfo, names: tuple[str, ...], listed: set[str]) -> None:
        number = self._free.pop() if self._free else len(self._files)
        if number == len(self._files):
            self._files.append(("", 0))
            self._owned.append(0)
        self._files[number] = (info.base_name, info.mtime_ns)
        self._number[info.base_name] = (info.size, number)
        self._newest = info.base_name
        # This file is now the newest to name each of its names (their previous owners own that many fewer).
        # A footer's names are distinct (compact.py writes a sorted set), so len(names) is what it owns.
        owners = self._names.assign(*hash_strings(names), number)
        for k, count in zip(*np.unique(owners[owners != ABSENT], return_counts=True)):
            self._owned[int(k)] -= int(count)
        self._owned[number] = len(names)
        for name in listed.intersection(names):
            before = self.on_disk.get(name)
            since = info.mtime_ns if before is None else min(before.since_ns, info.mtime_ns)
            self.on_disk[name] = Superseded(info.base_name, since)


_indexes: dict[str, _SupersededIndex] = {}
_indexes_lock = threading.Lock()


def _index_of(directory: Path) -> _SupersededIndex:
    with _indexes_lock:
        return _indexes.setdefault(str(directory), _SupersededIndex())


def _list_dir(dd: DataDir, directory: Path) -> list[pafs.FileInfo]:
    """The entries of `directory`; none if it does not exist (yet)."""
    try:
        return dd.filesystem.get_file_info(pafs.FileSelector(str(directory), allow_not_found=True))
    except FileNotFoundError:  # created by a writer between pyarrow's existence check and its listing
        return []


def _list_partition(dd: DataDir, directory: Path) -> list[pafs.FileInfo]:
    infos = _list_dir(dd, directory)
    return [
        i
        for i in infos
        if i.type == pafs.FileType.File
        and i.base_name.endswith(PARQUET_SUFFIX)
        and not i.base_name.startswith((".", "_"))
    ]


def _superseded(dd: DataDir, directory: Path, name: str) -> Superseded | None:
    """Whether a compacted file in `directory` supersedes `name` (which need not be on disk)."""
    index = _index_of(directory)
    with index.lock:
        index.update(dd, _list_partition(dd, directory))
        return index.superseded(name)


def superseded_by(root, path: str | Path) -> str | None:
    """The path of the compacted file that holds the rows of the data file `path` now, if one supersedes it
    (`path` may be deleted already); None if none does."""
    dd = as_datadir(root)
    path = Path(path)
    found = retry_vanished(lambda: _superseded(dd, path.parent, path.name), f"looking up {path}")
    return None if found is None else str(path.parent / found.by)


@dataclass(frozen=True)
class Listing:
    """One partition as a listing found it."""

    on_disk: list[pafs.FileInfo]  # every data file
    superseded: dict[str, Superseded]  # those of them that a compacted file supersedes
    unreadable: frozenset[str]  # compacted files, not superseded, whose footer cannot be read (_SupersededIndex)

    def live(self) -> list[pafs.FileInfo]:
        """The files a reader reads, sorted by name."""
        hidden = self.superseded.keys() | self.unreadable
        return sorted((i for i in self.on_disk if i.base_name not in hidden), key=lambda i: i.base_name)


def partition_listing(dd: DataDir, dataset: str, tenant: str) -> Listing:
    directory = dd.partition(dataset, tenant)
    index = _index_of(directory)
    with index.lock:
        infos = _list_partition(dd, directory)
        index.update(dd, infos)
        superseded = {n: s for n, s in index.on_disk.items() if s is not None}
        return Listing(infos, superseded, frozenset(n for n in index.unreadable if n not in superseded))


def partition_files(dd: DataDir, dataset: str, tenant: str) -> list[pafs.FileInfo]:
    """The live files of one partition (what a reader reads), sorted by name."""
    return partition_listing(dd, dataset, tenant).live()


def partition_tenants(root, dataset: str) -> list[str]:
    """Tenants that have a partition directory in `dataset`, sorted."""
    dd = as_datadir(root)
    infos = _list_dir(dd, dd.dataset(dataset))
    tenants = []
    for i in infos:
        if i.type == pafs.FileType.Directory and i.base_name.startswith("tenant="):
            tenant = i.base_name.removeprefix("tenant=")
            if tenant == UNKNOWN_TENANT or _valid_tenant(tenant):
                tenants.append(tenant)
    return sorted(tenants)


def _valid_tenant(tenant: str) -> bool:
    try:
        check_tenant(tenant)
    except InvalidName:
        return False
    return True


def live_files(root, dataset: str, tenant: str | None = None) -> list[str]:
    """Paths of the files a reader of `dataset` (one tenant or all) must read: each row exactly once."""
    dd = as_datadir(root)
    tenants = partition_tenants(dd, dataset) if tenant is None else [tenant]
    return [i.path for t in tenants for i in partition_files(dd, dataset, t)]


def unreadable_files(root, dataset: str, tenant: str | None = None) -> list[str]:
    """Paths of the compacted files of `dataset` (one tenant or all) that live_files leaves out because their
    footer cannot be read (see _SupersededIndex)."""
    dd = as_datadir(root)
    tenants = partition_tenants(dd, dataset) if tenant is None else [tenant]
    return [str(dd.partition(dataset, t) / name)
            for t in tenants for name in sorted(partition_listing(dd, dataset, t).unreadable)]


def live_rows(root, dataset: str, tenant: str | None = None) -> int:
    """How many rows the live files of `dataset` hold, from their footers (no data is read)."""
    dd = as_datadir(root)
    total = 0
    for path in live_files(dd, dataset, tenant):
        with dd.filesystem.open_input_file(path) as f:
            total += pq.ParquetFile(f).metadata.num_rows
    return total


def retry_vanished(fn: Callable[[], T], what: str) -> T:
    """Runs `fn`, again if a file it listed vanished before it was opened (a compaction finished meanwhile)."""
    for attempt in range(READ_ATTEMPTS):
        try:
            return fn()
        except FileNotFoundError as e:
            if attempt == READ_ATTEMPTS - 1:
                raise StorageError(f"{what}: files kept vanishing while reading ({e})") from e
            logger.debug("%s: %s vanished, listing again", what, e)
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------------------------------------
# Reading


def read_file(dd: DataDir, path: str, columns: list[str] | None = None) -> pa.Table:
    """One file as stored (no hive columns are added: every file carries its own tenant column)."""
    with dd.filesystem.open_input_file(path) as f:
        return pq.read_table(f, columns=columns)


def read_rows(dd: DataDir, path: str, rows: list[int]) -> pa.Table:
    """Rows `rows` (positions in the file, in that order) of one file, reading only the row groups that
    hold them: the learner takes a batch out of a large compacted file without reading all of it. No rows
    give an empty table with the file's schema (ingest asks for the rows of ids a file may not hold)."""
    with dd.filesystem.open_input_file(path) as f:
        pf = pq.ParquetFile(f)
        sizes = [pf.metadata.row_group(g).num_rows for g in range(pf.metadata.num_row_groups)]
        starts = [sum(sizes[:g]) for g in range(len(sizes))]
        group_of = [bisect.bisect_right(starts, r) - 1 for r in rows]
        groups = sorted(set(group_of))
        table = pf.read_row_groups(groups)
    at = {g: sum(sizes[h] for h in groups[:k]) for k, g in enumerate(groups)}  # where group g starts in `table`
    # Typed indices: an empty Python list would become a null array, which take() has no kernel for.
    return table.take(pa.array([at[g] + r - starts[g] for r, g in zip(rows, group_of)], pa.int64()))


def newest_ms(root, path: str, column: str) -> tuple[int | None, int]:
    """(the newest value of the timestamp column `column` in a file as epoch ms, its row count), from the
    footer's statistics; the column is read only when a row group has none. (None, 0) for a file without
    rows. Retention dates files by it, and compaction groups them by day."""
    with as_datadir(root).filesystem.open_input_file(path) as f:
        return newest_in(pq.ParquetFile(f), column, path)


def newest_in(pf: pq.ParquetFile, column: str, path: str) -> tuple[int | None, int]:
    """newest_ms of an open file (`path` names it in errors)."""
    meta = pf.metadata
    index = meta.schema.to_arrow_schema().get_field_index(column)
    if index < 0:
        raise ValueError(f"{path} has no {column} column")
    newest = None
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        if group.num_rows == 0:
            continue
        stats = group.column(index).statistics
        if stats is None or not stats.has_min_max:
            values = pf.read(columns=[column]).column(0).cast(pa.timestamp("ms", tz="UTC")).cast(pa.int64()).to_pylist()
            return max(values, default=None), meta.num_rows
        top = _epoch_ms(stats.max)
        newest = top if newest is None else max(newest, top)
    return newest, meta.num_rows


def _epoch_ms(value) -> int:
    if isinstance(value, datetime):
        if value.tzinfo is None:  # a timestamp without a zone (a file clora did not write) is UTC, not local time
            value = value.replace(tzinfo=timezone.utc)
        return round(value.timestamp() * 1000)
    return int(value)  # the physical value: clora's timestamps are milliseconds (schema.TS)


def read_dataset(root, dataset: str, tenant: str | None = None) -> pa.Table:
    """All rows of `dataset` (or of one tenant) in the current schema; an empty table if there are none."""
    dd = as_datadir(root)
    schema = SCHEMAS[check_dataset(dataset)]

    def read() -> pa.Table:
        tables = [conform(read_file(dd, p), schema, strict=False, what=p) for p in live_files(dd, dataset, tenant)]
        return pa.concat_tables(tables) if tables else schema.empty_table()

    return retry_vanished(read, f"reading {dataset}")


def column_max(root, dataset: str, column: str, tenant: str | None = None):
    """The largest value of `column` in the live files of `dataset` (one tenant or all), reading that column
    only; None where there are no rows (or only nulls). A file that cannot be read is logged and left out:
    what asks (the learner numbering a tenant's steps on) must not stop at one damaged file."""
    dd = as_datadir(root)
    check_dataset(dataset)

    def top(path: str):
        try:
            return pc.max(read_file(dd, path, columns=[column]).column(0)).as_py()
        except FileNotFoundError:
            raise
        except (OSError, pa.ArrowException) as e:
            logger.warning("%s: left out of the largest %s (%s: %s)", path, column, type(e).__name__, e)
            return None

    def read():
        tops = [top(p) for p in live_files(dd, dataset, tenant)]
        return max((t for t in tops if t is not None), default=None)

    return retry_vanished(read, f"reading {dataset}.{column}")


def read_ids(root, dataset: str, tenant: str | None = None) -> set[tuple[str, str]]:
    """{(tenant, id)} of `dataset` (interactions, feedback or trajectories): what ingest deduplicates by."""
    dd = as_datadir(root)
    if SCHEMAS[check_dataset(dataset)].get_field_index("id") < 0:
        raise InvalidName(f"dataset {dataset!r} has no id column")

    def read() -> set[tuple[str, str]]:
        ids: set[tuple[str, str]] = set()
        for p in live_files(dd, dataset, tenant):
            t = read_file(dd, p, columns=["tenant", "id"])
            ids.update(zip(t.column("tenant").to_pylist(), t.column("id").to_pylist()))
        return ids

    return retry_vanished(read, f"reading ids of {dataset}")
