"""storage/: everything clora keeps on disk. Ingest, learner and serving call these modules; none invents files.

    layout.py    DataDir: every path under the data dir
    schema.py    the pyarrow schemas of the five datasets (versioned)
    files.py     atomic, durable file operations and the writer lock (the only POSIX-aware code)
    parquet.py   write_dataset / read_dataset / read_ids over hive-partitioned Parquet
    compact.py   merging small files, safe under concurrent writes and reads
    query.py     DuckDB views over the datasets and the registry (`clora query`)
    registry.py  adapter versions tenant@n: create, publish, reject, rollback, retire, generation()
    cursors.py   the learner's per-tenant record of trained trajectories, committed with its checkpoint
    hashindex.py a set or int32 map of string keys held as 128-bit hashes (cursors' trained ids, superseded names)
    cli.py       `clora query`, `clora adapters`, `clora compact`

Imports nothing heavy here: `clora --help` imports storage.cli, which imports this package.
"""
