"""storage.layout, storage.schema and storage.parquet: paths, schemas, idempotent writes, clear errors."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from storage.layout import DATASETS, DataDir, InvalidName
from storage.parquet import live_files, read_dataset, read_ids, read_rows, split_by_tenant, write_dataset
from storage.schema import INTERACTIONS, SCHEMA_VERSION, SCHEMAS, TRAJECTORIES, SchemaMismatch

pytestmark = pytest.mark.unit


# ---------------------------------------------------------------------------------------------------------
# layout and schema


def test_datadir_paths(tmp_path):
    dd = DataDir(tmp_path)
    assert dd.root == tmp_path
    assert dd.dataset("trajectories") == tmp_path / "trajectories"
    assert dd.adapters == tmp_path / "adapters"
    assert dd.state == tmp_path / "state"
    assert dd.models == tmp_path / "models"
    assert dd.registry.parent == tmp_path
    with pytest.raises(InvalidName, match="nope"):
        dd.dataset("nope")


def test_every_schema_carries_its_version():
    assert set(SCHEMAS) == set(DATASETS)
    for name, schema in SCHEMAS.items():
        assert schema.metadata[b"clora.schema_version"] == str(SCHEMA_VERSION).encode()
        assert schema.metadata[b"clora.dataset"] == name.encode()


def test_trajectory_columns_and_types():
    ts = pa.timestamp("ms", tz="UTC")
    expected = {
        "id": pa.string(),
        "tenant": pa.string(),
        "ts": ts,
        "prompt": pa.string(),
        "messages_json": pa.string(),
        "completion": pa.string(),
        "reward": pa.float64(),
        "reward_source": pa.string(),
        "adapter_version": pa.string(),
        "prompt_token_ids": pa.list_(pa.int32()),
        "completion_token_ids": pa.list_(pa.int32()),
        "completion_logprobs": pa.list_(pa.float32()),
        "metadata_json": pa.string(),
        "kafka_topic": pa.string(),
        "kafka_partition": pa.int32(),
        "kafka_offset": pa.int64(),
        "ingested_at": ts,
    }
    assert {f.name: f.type for f in TRAJECTORIES} == expected
    assert TRAJECTORIES.field("adapter_version").nullable
    assert set(INTERACTIONS.names) == set(TRAJECTORIES.names) - {"reward", "reward_source"}


# ---------------------------------------------------------------------------------------------------------
# writing


def test_write_partitions_by_tenant_and_reads_back(data_dir, make_trajectories):
    table = pa.concat_tables([make_trajectories(["a", "b"], "acme"), make_trajectories(["c"], "globex")])
    paths = write_dataset(data_dir, "trajectories", table, file_id="p0-0-2")
    assert paths == [
        data_dir / "trajectories" / "tenant=acme" / "p0-0-2.parquet",
        data_dir / "trajectories" / "tenant=globex" / "p0-0-2.parquet",
    ]
    back = read_dataset(data_dir, "trajectories")
    assert back.schema == TRAJECTORIES
    assert sorted(back.column("id").to_pylist()) == ["a", "b", "c"]
    assert read_dataset(data_dir, "trajectories", "globex").column("id").to_pylist() == ["c"]
    assert read_ids(data_dir, "trajectories") == {("acme", "a"), ("acme", "b"), ("globex", "c")}
    assert read_ids(data_dir, "trajectories", "acme") == {("acme", "a"), ("acme", "b")}
    # Self-describing files: the footer names the schema version, and the tenant column is in the file.
    schema = pq.read_schema(paths[0])
    assert schema.metadata[b"clora.schema_version"] == str(SCHEMA_VERSION).encode()
    assert "tenant" in schema.names
    assert not [p for p in paths[0].parent.iterdir() if p.name.startswith(".")], "no temp files left behind"


def test_other_readers_read_a_dataset_as_the_readme_says(data_dir, make_trajectories):
    """The README's recipes for reading the files without clora: each file carries its own `tenant`
    column, so pyarrow's default hive inference (a dictionary `tenant`) does not merge with it."""
    import duckdb
    import pyarrow.dataset as ds

    write_dataset(data_dir, "trajectories", make_trajectories(["a", "b"], "acme"), file_id="f1")
    write_dataset(data_dir, "trajectories", make_trajectories(["c"], "globex"), file_id="f1")
    directory = data_dir / "trajectories"
    expected = [("a", "acme"), ("b", "acme"), ("c", "globex")]
    for table in (pq.read_table(directory, partitioning=None), ds.dataset(directory, format="parquet").to_table()):
        assert sorted(zip(table.column("id").to_pylist(), table.column("tenant").to_pylist())) == expected
    rows = duckdb.sql(f"select id, tenant from read_parquet('{directory}/*/*.parquet', hive_partitioning = false)")
    assert sorted(rows.fetchall()) == expected


def test_split_by_tenant_keeps_each_tenants_rows_in_order(make_trajectories):
    table = pa.concat_tables([make_trajectories(["b1"], "beta"), make_trajectories(["a1", "a2"], "acme"),
                              make_trajectories(["b2"], "beta"), make_trajectories(["a3"], "acme")])
    parts = split_by_tenant(table)
    assert [(t, rows.column("id").to_pylist()) for t, rows in parts] == [("acme", ["a1", "a2", "a3"]), ("beta", ["b1", "b2"])]
    assert split_by_tenant(table.slice(0, 0)) == []


def test_fresh_files_are_snappy_with_dictionaries_only_on_low_cardinality_columns(data_dir, make_trajectories):
    [path] = write_dataset(data_dir, "trajectories", make_trajectories(["a", "b"], "acme"), file_id="p0-0-1")
    meta = pq.ParquetFile(path).metadata.row_group(0)
    columns = {meta.column(i).path_in_schema: meta.column(i) for i in range(meta.num_columns)}
    assert {c.compression for c in columns.values()} == {"SNAPPY"}
    dictionary = {name for name, c in columns.items() if c.has_dictionary_page}
    assert "tenant" in dictionary and "reward_source" in dictionary
    assert not dictionary & {"id", "completion", "prompt", "messages_json"}


def test_same_file_id_twice_is_one_file(data_dir, make_trajectories):
    first = write_dataset(data_dir, "trajectories", make_trajectories(["a", "b"]), file_id="batch-7")
    mtime = first[0].stat().st_mtime_ns
    again = write_dataset(data_dir, "trajectories", make_trajectories(["a", "b"]), file_id="batch-7")
    assert again == first
    assert first[0].stat().st_mtime_ns == mtime, "a replayed write must leave the existing file alone"
    assert len(live_files(data_dir, "trajectories")) == 1
    assert read_dataset(data_dir, "trajectories").num_rows == 2


def test_empty_dataset_reads_as_empty_table_with_schema(data_dir):
    for name, schema in SCHEMAS.items():
        table = read_dataset(data_dir, name)
        assert table.num_rows == 0 and table.schema == schema
    assert read_ids(data_dir, "feedback") == set()
    assert write_dataset(data_dir, "trajectories", TRAJECTORIES.empty_table(), file_id="nothing") == []


def test_casts_compatible_types(data_dir, make_trajectories):
    table = make_trajectories(["a"])
    table = table.set_column(table.schema.get_field_index("kafka_partition"), "kafka_partition", pa.array([3], pa.int64()))
    table = table.set_column(table.schema.get_field_index("reward"), "reward", pa.array([1], pa.int64()))
    table = table.drop_columns(["metadata_json", "adapter_version"])  # nullable: filled with nulls
    write_dataset(data_dir, "trajectories", table, file_id="f")
    back = read_dataset(data_dir, "trajectories")
    assert back.column("kafka_partition").to_pylist() == [3]
    assert back.column("reward").to_pylist() == [1.0]
    assert back.column("metadata_json").to_pylist() == [None]


@pytest.mark.parametrize(
    "change, column",
    [
        (lambda t: t.set_column(t.schema.get_field_index("reward"), "reward", pa.array(["high"])), "reward"),
        (lambda t: t.set_column(t.schema.get_field_index("ts"), "ts", pa.array(["yesterday"])), "ts"),
        (lambda t: t.append_column("rewrad", pa.array([1.0])), "rewrad"),
        (lambda t: t.drop_columns(["ingested_at"]), "ingested_at"),
        (lambda t: t.set_column(t.schema.get_field_index("id"), "id", pa.array([None], pa.string())), "id"),
        (
            lambda t: t.set_column(
                t.schema.get_field_index("completion_token_ids"), "completion_token_ids", pa.array([["x"]])
            ),
            "completion_token_ids",
        ),
    ],
    ids=["wrong-type", "string-for-timestamp", "unknown-column", "missing-required", "null-required", "list-of-strings"],
)
def test_schema_mismatch_names_the_column(data_dir, make_trajectories, change, column):
    with pytest.raises(SchemaMismatch, match=repr(column)):
        write_dataset(data_dir, "trajectories", change(make_trajectories(["a"])), file_id="f")
    assert live_files(data_dir, "trajectories") == []


@pytest.mark.parametrize("file_id", ["", "../escape", "a/b", ".hidden", "_meta", "compacted-x", "sp ace"])
def test_bad_file_ids_are_refused(data_dir, make_trajectories, file_id):
    with pytest.raises(InvalidName):
        write_dataset(data_dir, "trajectories", make_trajectories(["a"]), file_id=file_id)


def test_bad_tenant_is_refused_but_dead_letters_take_unknown(data_dir, make_trajectories):
    with pytest.raises(InvalidName, match="../x"):
        write_dataset(data_dir, "trajectories", make_trajectories(["a"], tenant="../x"), file_id="f")
    with pytest.raises(InvalidName, match="_unknown"):
        write_dataset(data_dir, "trajectories", make_trajectories(["a"], tenant="_unknown"), file_id="f")
    dead = pa.table(
        {
            "tenant": ["_unknown"],
            "reason": ["invalid_json"],
            "detail": ["Expecting value"],
            "raw": [b"{not json"],
            "kafka_topic": ["clora.interactions"],
            "kafka_partition": [0],
            "kafka_offset": [5],
            "ingested_at": pa.array([0], pa.timestamp("ms", tz="UTC")),
        }
    )
    write_dataset(data_dir, "dead_letters", dead, file_id="dl-0")
    assert read_dataset(data_dir, "dead_letters").column("raw").to_pylist() == [b"{not json"]


def test_files_of_an_older_schema_stay_readable(data_dir, make_trajectories):
    """A file lacking a (nullable) column that a later schema added reads with nulls there."""
    old = make_trajectories(["a"]).drop_columns(["completion_logprobs"])
    directory = data_dir / "trajectories" / "tenant=acme"
    directory.mkdir(parents=True)
    pq.write_table(old, directory / "old.parquet")
    back = read_dataset(data_dir, "trajectories")
    assert back.schema == TRAJECTORIES
    assert back.column("completion_logprobs").to_pylist() == [None]


def test_prompt_token_ids_are_a_nullable_column_that_files_written_before_it_read_as_nulls(data_dir, make_trajectories):
    """prompt_token_ids (a prompt sent as token ids) came after the first version-1 files: those lack it, and
    read with nulls there; compaction finds nothing in them it would lose."""
    from storage.schema import conform, conform_loses

    for schema in (INTERACTIONS, TRAJECTORIES):
        field = schema.field("prompt_token_ids")
        assert field.nullable and field.type == schema.field("completion_token_ids").type == pa.list_(pa.int32())
    old = make_trajectories(["a", "b"])
    assert "prompt_token_ids" not in old.column_names  # what a file of the version before looks like
    directory = data_dir / "trajectories" / "tenant=acme"
    directory.mkdir(parents=True)
    pq.write_table(old, directory / "old.parquet")
    back = read_dataset(data_dir, "trajectories")
    assert back.schema == TRAJECTORIES and back.column("prompt_token_ids").to_pylist() == [None, None]
    assert conform_loses(pq.read_schema(directory / "old.parquet"), TRAJECTORIES) is None
    old_interactions = old.drop_columns(["reward", "reward_source"])
    assert conform(old_interactions, INTERACTIONS, strict=False).column("prompt_token_ids").to_pylist() == [None, None]
    new = conform(old.append_column("prompt_token_ids", pa.array([[74, 71, 78, 78, 81], None], pa.list_(pa.int64()))),
                  TRAJECTORIES)
    write_dataset(data_dir, "trajectories", new, file_id="new")
    rows = read_dataset(data_dir, "trajectories").to_pylist()
    assert sorted((r["id"], r["prompt_token_ids"] or []) for r in rows) == [
        ("a", []), ("a", [74, 71, 78, 78, 81]), ("b", []), ("b", [])]


def test_read_rows_reads_the_rows_asked_for_in_order(tmp_path, make_trajectories):
    table = make_trajectories([f"id{i:02d}" for i in range(20)])
    path = tmp_path / "groups.parquet"
    pq.write_table(table, path, row_group_size=3)
    assert pq.ParquetFile(path).metadata.num_row_groups == 7
    rows = [19, 0, 7, 8, 3, 7]
    got = read_rows(DataDir(tmp_path), str(path), rows)
    assert got.column("id").to_pylist() == [f"id{i:02d}" for i in rows]
    assert got.equals(table.take(rows))


def test_read_rows_of_no_rows_is_an_empty_table_with_the_files_schema(tmp_path, make_trajectories):
    path = tmp_path / "t.parquet"
    pq.write_table(make_trajectories(["a", "b"]), path)
    got = read_rows(DataDir(tmp_path), str(path), [])
    assert got.num_rows == 0 and got.schema == pq.read_schema(path)


def test_new_directories_and_replayed_files_are_made_durable_in_their_parents(tmp_path, monkeypatch):
    """A power loss must not take a new `tenant=` directory (and the files fsynced into it) with it, nor a
    file whose link landed just before a crash (its replay finds it and makes it durable)."""
    import storage.files as files

    synced = []
    monkeypatch.setattr(files, "fsync_dir", lambda d: synced.append(d))
    target = tmp_path / "trajectories" / "tenant=acme" / "f.parquet"
    (tmp_path / "trajectories").mkdir()
    assert files.write_new_file(target, lambda tmp: tmp.write_bytes(b"x"))
    # the new tenant= directory in its parent, then the file in the new directory
    assert synced == [tmp_path / "trajectories", target.parent]
    synced.clear()
    assert not files.write_new_file(target, lambda tmp: tmp.write_bytes(b"y"))  # a replay: nothing written ...
    assert synced == [target.parent] and target.read_bytes() == b"x"  # ... but the directory made durable
