"""SQL over everything clora stores: an in-memory DuckDB with one view per dataset and one for adapters.

Views: interactions, feedback, trajectories, dead_letters, train_steps (one per Parquet dataset, columns as
in schema.py) and adapters (one row per registry version).

Each dataset view reads an explicit list of files, `parquet.live_files`, rather than a glob: a glob would
count rows twice while compacted inputs still lie on disk (until compaction's grace period is over). The
files are read with union_by_name (files written by older schema versions lack new columns) and without
hive partitioning: every file carries its own `tenant` column, and DuckDB would read `key=value` from
every directory of the path, so a data dir under, say, /data/run=3/ gained a `run` column. They are
unioned BY NAME with an empty table of the current schema, so every view has every column, with the right
type, even when a dataset has no files yet (a query then returns 0 rows).

The views are a snapshot of the file list at `connect()` time: files written later appear on the next
connect. Compaction deletes merged inputs only after a grace period (compact.GRACE_S, 60 s), so a
connection younger than that can always read its files; `query` (one connection per call) lists again and
retries if a file vanished anyway. Nothing here takes a lock or opens a file for writing, so queries never
block ingest, the learner or compaction, and any number of processes may query at once.

Moving the data dir to object storage: DuckDB reads s3:// paths with its httpfs extension; live_files
would list through the pyarrow S3 filesystem (see layout.py).
"""

from __future__ import annotations

import json
import logging
import re

import duckdb
import pyarrow as pa

from storage.layout import DATASETS, as_datadir
from storage.parquet import live_files
from storage.registry import AdapterVersion, Registry
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


def connect(root) -> duckdb.DuckDBPyConnection:
    """A fresh in-memory DuckDB connection with the views over `root`."""
    dd = as_datadir(root)
    for attempt in range(QUERY_ATTEMPTS):
        con = duckdb.connect(":memory:")
        try:
            con.execute("SET TimeZone = 'UTC'")
            # DuckDB opens the files when it creates a view (to learn their columns), so a compaction that
            # deletes a listed file in between fails here: list again.
            for dataset in DATASETS:
                _create_view(con, dataset, SCHEMAS[dataset].empty_table(), live_files(dd, dataset))
            _create_view(con, "adapters", adapters_table(Registry(dd).versions()), [])
            return con
        except (duckdb.IOException, FileNotFoundError) as e:  # the listing itself reads compacted files' footers
            con.close()
            if attempt == QUERY_ATTEMPTS - 1:
                raise
            logger.debug("a listed file vanished while creating views, listing again: %s", e)
    raise AssertionError("unreachable")


def query(root, sql: str) -> pa.Table:
    """Runs `sql` against the views; returns the result (an empty table for statements without one)."""
    for attempt in range(QUERY_ATTEMPTS):
        con = connect(root)
        try:
            rel = con.sql(sql)
            return pa.table({}) if rel is None else _to_arrow(rel)
        except duckdb.IOException as e:
            # A compaction deleted a file between our listing and DuckDB reading it; the next listing has
            # the merged file instead.
            if attempt == QUERY_ATTEMPTS - 1:
                raise
            logger.debug("query hit a vanished file, retrying: %s", e)
        finally:
            con.close()
    raise AssertionError("unreachable")


def _to_arrow(rel: duckdb.DuckDBPyRelation) -> pa.Table:
    # duckdb >= 1.4 names it to_arrow_table (fetch_arrow_table is deprecated there, absent nowhere yet).
    fetch = getattr(rel, "to_arrow_table", None) or rel.fetch_arrow_table
    return fetch()


def _sql_str(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def _create_view(con: duckdb.DuckDBPyConnection, name: str, typed: pa.Table, files: list[str]) -> None:
    """View `name` = the rows of `typed` plus those of `files`, with at least `typed`'s columns and types."""
    con.register("_clora_arrow", typed)
    con.execute(f'CREATE TABLE "_clora_{name}" AS SELECT * FROM _clora_arrow')
    con.unregister("_clora_arrow")
    select = f'SELECT * FROM "_clora_{name}"'
    if files:
        file_list = ", ".join(_sql_str(f) for f in files)
        select += (
            f" UNION ALL BY NAME SELECT * FROM read_parquet([{file_list}], hive_partitioning = false, "
            "union_by_name = true)"
        )
    con.execute(f'CREATE VIEW "{name}" AS {select}')


# ---------------------------------------------------------------------------------------------------------
# The adapters view


def adapters_table(versions: list[AdapterVersion]) -> pa.Table:
    """One row per version: ADAPTERS_SCHEMA plus a metric_<key> column per scalar metric."""
    latest: dict[str, int] = {}
    for v in versions:
        if v.status == "published":
            latest[v.tenant] = max(latest.get(v.tenant, 0), v.number)
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
    """metric_<key> for every metric whose values are all numbers (or all strings / all booleans)."""
    keys = sorted({k for v in versions for k in v.metrics})
    out = {}
    for key in keys:
        values = [v.metrics.get(key) for v in versions]
        present = [x for x in values if x is not None]
        if all(isinstance(x, bool) for x in present):
            type_ = pa.bool_()
        elif all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in present):
            type_ = pa.float64()
        elif all(isinstance(x, str) for x in present):
            type_ = pa.string()
        else:
            continue  # nested or mixed: only in the metrics JSON
        column = "metric_" + re.sub(r"[^A-Za-z0-9_]", "_", key)
        if column not in out:
            out[column] = pa.array(values, type_)
    return out
