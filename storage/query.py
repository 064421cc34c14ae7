"""SQL over everything clora stores: an in-memory DuckDB with one view per dataset and one for adapters.

Views: interactions, feedback, trajectories, dead_letters, train_steps (one per Parquet dataset, columns as
in schema.py) and adapters (one row per registry version). `query` builds the adapters view only when the
SQL names it (it reads every registry record, the whole history of every tenant; otherwise the view is
empty), and leaves out, with a warning, records it cannot read. Likewise a dataset's view reads its files
only when the SQL names it: DuckDB reads the footer of every file a view lists when it creates the view,
so otherwise one damaged file would fail every query, `select 1` included.

Each dataset view reads an explicit list of files, `parquet.live_files`, rather than a glob: a glob would
count rows twice while compacted inputs still lie on disk (until compaction's grace period is over). The
files are read with union_by_name (files written by older schema versions lack new columns) and without
hive partitioning: every file carries its own `tenant` column, and DuckDB would read `key=value` from
every directory of the path, so a data dir under, say, /data/run=3/ gained a `run` column. They are
unioned BY NAME with an empty table of the current schema, so every view has every column, with the right
type, even when a dataset has no files yet (a query then returns 0 rows). DuckDB reads every listed path as
a glob pattern, so *, ? and [ in them are escaped.

The views are a snapshot of the file list at `connect()` time: files written later appear on the next
connect. Compaction deletes merged inputs only after a grace period (compact.GRACE_S, 60 s), so a
connection younger than that can always read its files; `query` (one connection per call) lists again and
retries if a file it listed vanished anyway (only then: any other error is the statement's own, and running
it again would repeat its side effects). Nothing here takes a lock or opens a file for writing, so queries
never block ingest, the learner or compaction, and any number of processes may query at once.

A statement runs on a worker thread while the caller's thread waits for it, so that Ctrl-C (a
KeyboardInterrupt) interrupts the connection rather than waiting for DuckDB to finish.

Moving the data dir to object storage: DuckDB reads s3:// paths with its httpfs extension; live_files
would list through the pyarrow S3 filesystem (see layout.py).
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading

import duckdb
import pyarrow as pa

from storage.layout import DATASETS, StorageError, as_datadir
from storage.parquet import live_files
from storage.registry import AdapterVersion, Registry, UnreadableRecord, VersionNotFound
from storage.schema import SCHEMAS, TS

logger = logging.getLogger(__name__)

VIEWS = (*DATASETS, "adapters")
QUERY_ATTEMPTS = 5

ADAPTERS_SCHEMA = pa.schema(
    [
        ("tenant", pa.string()),
        ("number", pa.int64()),
        ("name", pa.string()),
        ("parent", pa.string()),
        ("status", pa.string()),
        ("latest", pa.bool_()),  # the tenant's newest published version: what serving routes the tenant to
        ("path", pa.string()),
        ("created_at", TS),
        ("published_at", TS),
        ("retired_at", TS),
        ("reason", pa.string()),
        ("metrics", pa.string()),  # JSON; also flattened below as metric_<key> columns
        ("trajectory_range", pa.string()),  # JSON
        ("gate", pa.string()),  # JSON
    ]
)


def connect(root, *, adapters: bool = True) -> duckdb.DuckDBPyConnection:
    """A fresh in-memory DuckDB connection with the views over `root`. With `adapters=False` the adapters view
    is empty (its columns only): building it reads every registry record, the whole history of every tenant."""
    return _connect(as_datadir(root), adapters)[0]


def _connect(dd, adapters: bool, datasets=DATASETS) -> tuple[duckdb.DuckDBPyConnection, list[str]]:
    """(the connection, every dataset file its views read). The views of datasets not in `datasets` are
    empty (their columns only): DuckDB reads every listed file's footer when it creates a view, so one
    damaged file would fail every statement, `select 1` and the adapters view included."""
    typed_adapters = adapters_table([])
    if adapters:
        registry = Registry(dd)
        typed_adapters = adapters_table(readable_versions(registry), served_or_none(registry))
    for attempt in range(QUERY_ATTEMPTS):
        con = duckdb.connect(":memory:")
        try:
            con.execute("SET TimeZone = 'UTC'")
            # DuckDB opens the files when it creates a view (to learn their columns), so a compaction that
            # deletes a listed file in between fails here: list again.
            listed = []
            for dataset in DATASETS:
                files = live_files(dd, dataset) if dataset in datasets else []
                listed += files
                _create_view(con, dataset, SCHEMAS[dataset].empty_table(), files)
            _create_view(con, "adapters", typed_adapters, [])
            return con, listed
        except (duckdb.IOException, FileNotFoundError) as e:  # the listing itself reads compacted files' footers
            con.close()
            if attempt == QUERY_ATTEMPTS - 1:
                raise
            logger.debug("a listed file vanished while creating views, listing again: %s", e)
    raise AssertionError("unreachable")


def served_or_none(registry: Registry) -> dict[str, AdapterVersion] | None:
    """Registry.published() (HEAD.json: what serving routes to), for `adapters_table`'s `latest`; None, logged,
    while HEAD.json cannot be read (`latest` then comes from the version records)."""
    try:
        return registry.published()
    except UnreadableRecord as e:
        logger.warning("`latest` is read from the version records: %s", e)
        return None


def readable_versions(registry: Registry) -> list[AdapterVersion]:
    """Every version of every tenant (as Registry.versions()), less those whose record cannot be read (damaged
    by hand, or written by a newer clora in a rolling upgrade): each is logged, and the other views still work."""
    out, unreadable = [], []
    for tenant in registry.tenants():
        for number in registry.numbers(tenant):  # versions() stops at the first unreadable one
            try:
                out.append(registry.get(tenant, number))
            except VersionNotFound:  # deleted since the listing (retention: `prune`)
                continue
            except (StorageError, OSError, ValueError, KeyError, TypeError) as e:
                unreadable.append(f"{tenant}@{number} ({type(e).__name__}: {e})")
    if unreadable:
        logger.warning("the adapters view leaves out %d registry record(s) that cannot be read: %s",
                       len(unreadable), "; ".join(unreadable))
    return out


def mentions(sql: str, view: str) -> bool:
    """Whether `sql` may read `view` (its name as a word, in any case, anywhere: a superset is harmless)."""
    return re.search(rf"\b{view}\b", sql, re.IGNORECASE) is not None


def query(root, sql: str) -> pa.Table:
    """Runs `sql` against the views; returns the result (an empty table for statements without one).

    The adapters view is built, and a dataset's view reads its files, only when `sql` names it. The statement runs again only when it failed on a
    dataset file that vanished (a compaction deleted it between our listing and DuckDB reading it); any other
    error, a user's own IO error included, is raised at once (the statement may have had side effects)."""
    dd = as_datadir(root)
    adapters = mentions(sql, "adapters")
    datasets = [d for d in DATASETS if mentions(sql, d)]
    for attempt in range(QUERY_ATTEMPTS):
        con, listed = _connect(dd, adapters, datasets)
        try:
            return _interruptible(con, sql)
        except duckdb.IOException as e:
            if attempt == QUERY_ATTEMPTS - 1 or not _names_a_listed_file(str(e), listed):
                raise
            logger.debug("query hit a vanished file, retrying: %s", e)
        finally:
            con.close()
    raise AssertionError("unreachable")


def _interruptible(con: duckdb.DuckDBPyConnection, sql: str) -> pa.Table:
    """Runs `sql` to its result on a worker thread, so that Ctrl-C stops it: Python runs signal handlers on
    the main thread only, between bytecodes, and a main thread inside DuckDB would not see the
    KeyboardInterrupt until the statement ended. On one, the connection is interrupted, the worker is let
    finish (DuckDB stops within milliseconds) and the KeyboardInterrupt goes on to the caller."""
    outcome: dict[str, object] = {}
    done = threading.Event()  # not Thread.join: a join a KeyboardInterrupt cut short marks the thread ended

    def run() -> None:
        try:
            rel = con.sql(sql)  # lazy for a query: it runs when the result is fetched, below
            outcome["table"] = pa.table({}) if rel is None else _to_arrow(rel)
        except BaseException as e:  # noqa: BLE001 (handed to the main thread, which raises it)
            outcome["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name="clora-query", daemon=True).start()
    try:
        done.wait()
    except KeyboardInterrupt:
        con.interrupt()
        done.wait()  # the connection is closed next, which DuckDB refuses while the statement runs
        raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome["table"]


def _names_a_listed_file(message: str, listed: list[str]) -> bool:
    return any(f in message or _glob_escape(f) in message for f in listed)


def _to_arrow(rel: duckdb.DuckDBPyRelation) -> pa.Table:
    # duckdb >= 1.4 names it to_arrow_table (fetch_arrow_table is deprecated there, absent nowhere yet).
    fetch = getattr(rel, "to_arrow_table", None) or rel.fetch_arrow_table
    return fetch()


def _sql_str(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def _glob_escape(path: str) -> str:
    """`path` as a DuckDB glob pattern matching only itself: read_parquet expands *, ? and [...] in every path
    it is given, so a data dir under, say, /data/run[1]/ would read another directory's files."""
    return re.sub(r"([*?\[])", r"[\1]", path)


def _create_view(con: duckdb.DuckDBPyConnection, name: str, typed: pa.Table, files: list[str]) -> None:
    """View `name` = the rows of `typed` plus those of `files`, with at least `typed`'s columns and types."""
    con.register("_clora_arrow", typed)
    con.execute(f'CREATE TABLE "_clora_{name}" AS SELECT * FROM _clora_arrow')
    con.unregister("_clora_arrow")
    select = f'SELECT * FROM "_clora_{name}"'
    if files:
        file_list = ", ".join(_sql_str(_glob_escape(f)) for f in files)
        select += (
            f" UNION ALL BY NAME SELECT * FROM read_parquet([{file_list}], hive_partitioning = false, "
            "union_by_name = true)"
        )
    con.execute(f'CREATE VIEW "{name}" AS {select}')


# ---------------------------------------------------------------------------------------------------------
# The adapters view


def adapters_table(versions: list[AdapterVersion], served: dict[str, AdapterVersion] | None = None) -> pa.Table:
    """One row per version: ADAPTERS_SCHEMA plus a metric_<key> column per scalar metric. `latest` marks what
    serving routes a tenant to, HEAD.json's entry (`served`, Registry.published()), where it is given; else
    each tenant's newest published version among `versions` (a record that cannot be read is not among them,
    while HEAD.json may still name it)."""
    latest: dict[str, int] = {}
    for v in versions:
        if v.status == "published":
            latest[v.tenant] = max(latest.get(v.tenant, 0), v.number)
    if served is not None:
        latest = {tenant: v.number for tenant, v in served.items()}
    rows = {
        "tenant": [v.tenant for v in versions],
        "number": [v.number for v in versions],
        "name": [v.name for v in versions],
        "parent": [v.parent for v in versions],
        "status": [v.status for v in versions],
        "latest": [latest.get(v.tenant) == v.number for v in versions],
        "path": [str(v.path) for v in versions],
        "created_at": [v.created_at for v in versions],
        "published_at": [v.published_at for v in versions],
        "retired_at": [v.retired_at for v in versions],
        "reason": [v.reason for v in versions],
        "metrics": [json.dumps(v.metrics, sort_keys=True) for v in versions],
        "trajectory_range": [json.dumps(v.trajectory_range, sort_keys=True) for v in versions],
        "gate": [None if v.gate is None else json.dumps(v.gate, sort_keys=True) for v in versions],
    }
    table = pa.table(rows, schema=ADAPTERS_SCHEMA)
    for key, column in _metric_columns(versions).items():
        table = table.append_column(key, column)
    return table


def _metric_columns(versions: list[AdapterVersion]) -> dict[str, pa.Array]:
    """metric_<key> for every metric whose values are all numbers (or all strings / all booleans). The learner
    stores a non-finite number as a string ("nan", "inf"): that is a number here (NaN, inf)."""
    # Of keys differing only in case, the lower-case one (the learner's) gets the column.
    keys = sorted({k for v in versions for k in v.metrics}, key=lambda k: (k.lower(), k != k.lower(), k))
    out, seen = {}, set()
    for key in keys:
        values = [v.metrics.get(key) for v in versions]
        present = [x for x in values if x is not None]
        if all(isinstance(x, bool) for x in present):
            type_ = pa.bool_()
        elif all(_is_number(x) for x in present):
            type_ = pa.float64()
            values = [None if x is None else float(x) for x in values]
        elif all(isinstance(x, str) for x in present):
            type_ = pa.string()
        else:
            continue  # nested or mixed: only in the metrics JSON
        column = "metric_" + re.sub(r"[^A-Za-z0-9_]", "_", key)
        if column.lower() not in seen:  # DuckDB's names ignore case: metric_Loss would shadow metric_loss
            seen.add(column.lower())
            out[column] = pa.array(values, type_)
    return out


def _is_number(x) -> bool:
    if isinstance(x, bool):
        return False
    if isinstance(x, (int, float)):
        return True
    if isinstance(x, str):  # only the non-finite ones: "0.5" stays a string
        try:
            return not math.isfinite(float(x))
        except ValueError:
            return False
    return False
