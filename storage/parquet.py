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
A reader whose file vanishes between listing and opening (compaction deleted it) lists again.

Plain Parquet readers that glob the tree (DuckDB, Spark, pandas) count superseded inputs twice until
compaction deletes them; `clora query` and every clora reader use `live_files` and never do.

This module knows nothing of what the rows mean; schemas live in schema.py.
"""

from __future__ import annotations

import bisect
import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from storage.files import fsync_dir, write_new_file
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
    absorbed_by = _superseded_by(dd, directory).get(name)
    if absorbed_by is not None:
        logger.debug("%s was already compacted into %s; not rewriting it", final, absorbed_by)
        return directory / absorbed_by
    write_new_file(final, lambda tmp: pq.write_table(rows, tmp, **parquet_options(rows.schema, FRESH_COMPRESSION)))
    return final


# ---------------------------------------------------------------------------------------------------------
# Which files to read


class _FooterCache:
    """name lists of compacted files' footers; a compacted file never changes, so (path, size) keys it."""

    def __init__(self, limit: int = 4096):
        self._data: dict[tuple[str, int], tuple[str, ...]] = {}
        self._lock = threading.Lock()
        self._limit = limit

    def get(self, fs: pafs.FileSystem, info: pafs.FileInfo) -> tuple[str, ...]:
        key = (info.path, info.size)
        with self._lock:
            hit = self._data.get(key)
        if hit is not None:
            return hit
        names = read_supersedes(fs, info.path)
        with self._lock:
            if len(self._data) >= self._limit:
                self._data.clear()
            self._data[key] = names
        return names


_footers = _FooterCache()


def supersedes(dd: DataDir, info: pafs.FileInfo) -> tuple[str, ...]:
    """The names a compacted file supersedes (from its footer; cached, the file never changes)."""
    return _footers.get(dd.filesystem, info)


def read_supersedes(fs: pafs.FileSystem, path: str) -> tuple[str, ...]:
    with fs.open_input_file(path) as f:
        meta = pq.read_metadata(f).metadata or {}
    return tuple(json.loads(meta.get(SUPERSEDES_KEY, b"[]")))


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


def _superseded_by(dd: DataDir, directory: Path, infos: list[pafs.FileInfo] | None = None) -> dict[str, str]:
    """name -> the newest compacted file (in this partition) that supersedes it.

    Newest (names sort by creation time) because a later merge of a compacted file supersedes what that
    file superseded: the newest superseder is the live file that now holds the rows.
    """
    infos = _list_partition(dd, directory) if infos is None else infos
    out: dict[str, str] = {}
    for info in sorted(infos, key=lambda i: i.base_name, reverse=True):
        if info.base_name.startswith(COMPACTED_PREFIX):
            for name in supersedes(dd, info):
                out.setdefault(name, info.base_name)
    return out


def partition_listing(dd: DataDir, dataset: str, tenant: str) -> tuple[list[pafs.FileInfo], dict[str, str]]:
    """(every data file on disk, superseded name -> the compacted file superseding it) of one partition."""
    directory = dd.partition(dataset, tenant)
    infos = _list_partition(dd, directory)
    return infos, _superseded_by(dd, directory, infos)


def partition_files(dd: DataDir, dataset: str, tenant: str) -> list[pafs.FileInfo]:
    """The live files of one partition (what a reader reads), sorted by name."""
    infos, superseded = partition_listing(dd, dataset, tenant)
    return sorted((i for i in infos if i.base_name not in superseded), key=lambda i: i.base_name)


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
    hold them: the learner takes a batch out of a large compacted file without reading all of it."""
    with dd.filesystem.open_input_file(path) as f:
        pf = pq.ParquetFile(f)
        sizes = [pf.metadata.row_group(g).num_rows for g in range(pf.metadata.num_row_groups)]
        starts = [sum(sizes[:g]) for g in range(len(sizes))]
        group_of = [bisect.bisect_right(starts, r) - 1 for r in rows]
        groups = sorted(set(group_of))
        table = pf.read_row_groups(groups)
    at = {g: sum(sizes[h] for h in groups[:k]) for k, g in enumerate(groups)}  # where group g starts in `table`
    return table.take([at[g] + r - starts[g] for r, g in zip(rows, group_of)])


def read_dataset(root, dataset: str, tenant: str | None = None) -> pa.Table:
    """All rows of `dataset` (or of one tenant) in the current schema; an empty table if there are none."""
    dd = as_datadir(root)
    schema = SCHEMAS[check_dataset(dataset)]

    def read() -> pa.Table:
        tables = [conform(read_file(dd, p), schema, strict=False) for p in live_files(dd, dataset, tenant)]
        return pa.concat_tables(tables) if tables else schema.empty_table()

    return retry_vanished(read, f"reading {dataset}")


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
