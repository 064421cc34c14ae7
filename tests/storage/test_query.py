"""storage.query: the DuckDB views agree with the files, exist when empty, and reflect the registry."""

from __future__ import annotations

import duckdb
import pyarrow as pa
import pytest

from storage.layout import DATASETS
from storage.parquet import write_dataset
from storage.query import VIEWS, connect, query
from storage.registry import Registry
from storage.schema import SCHEMAS

pytestmark = pytest.mark.unit


def _fill(data_dir, make_trajectories):
    for f, (tenant, reward) in enumerate([("acme", 0.2), ("acme", 0.6), ("globex", -0.5), ("initech", 1.0)]):
        ids = [f"{tenant}-{f}-{k}" for k in range(f + 2)]
        write_dataset(data_dir, "trajectories", make_trajectories(ids, tenant, start=f * 10, reward=reward), file_id=f"f{f}")


def test_query_matches_duckdb_reading_the_files(data_dir, make_trajectories):
    _fill(data_dir, make_trajectories)
    sql = "select tenant, count(*), avg(reward) from {} group by 1 order by 1"
    ours = [tuple(r.values()) for r in query(data_dir, sql.format("trajectories")).to_pylist()]
    direct = duckdb.sql(
        sql.format(f"read_parquet('{data_dir}/trajectories/*/*.parquet', hive_partitioning = true)")
    ).fetchall()
    # Same groups and counts; the averages equal up to float summation order.
    assert [(t, n) for t, n, _ in ours] == [(t, n) for t, n, _ in direct]
    assert [a for _, _, a in ours] == pytest.approx([a for _, _, a in direct], rel=1e-12)
    assert ours[0] == ("acme", 5, pytest.approx((2 * 0.2 + 3 * 0.6) / 5))
    assert [t for t, _, _ in ours] == ["acme", "globex", "initech"]


def test_views_exist_with_columns_when_nothing_is_stored(data_dir):
    con = connect(data_dir)
    for name in DATASETS:
        assert con.sql(f"select count(*) from {name}").fetchall() == [(0,)]
        columns = [row[0] for row in con.sql(f"describe {name}").fetchall()]
        assert columns == SCHEMAS[name].names
    assert con.sql("select count(*) from adapters").fetchall() == [(0,)]
    assert "status" in [row[0] for row in con.sql("describe adapters").fetchall()]
    assert query(data_dir, "select avg(reward) as r from trajectories").to_pylist() == [{"r": None}]
    assert set(VIEWS) == {*DATASETS, "adapters"}


def test_views_have_every_column_even_if_files_are_older(data_dir, make_trajectories):
    """Files from an older schema (missing a column) still give a view with the column, as nulls."""
    import pyarrow.parquet as pq

    old = make_trajectories(["a"]).drop_columns(["completion_logprobs"])
    (data_dir / "trajectories" / "tenant=acme").mkdir(parents=True)
    pq.write_table(old, data_dir / "trajectories" / "tenant=acme" / "old.parquet")
    rows = query(data_dir, "select id, completion_logprobs, ts from trajectories").to_pylist()
    assert rows[0]["id"] == "a" and rows[0]["completion_logprobs"] is None
    assert query(data_dir, "select typeof(ts) as t from trajectories").to_pylist() == [{"t": "TIMESTAMP WITH TIME ZONE"}]


def test_numeric_tenant_names_stay_strings(data_dir, make_trajectories):
    write_dataset(data_dir, "trajectories", make_trajectories(["a"], tenant="123"), file_id="f")
    write_dataset(data_dir, "trajectories", make_trajectories(["b"], tenant="acme"), file_id="f")
    assert query(data_dir, "select tenant from trajectories order by 1").column("tenant").to_pylist() == ["123", "acme"]


def test_adapters_and_train_steps_views_follow_the_registry(data_dir, peft_writer, make_train_steps):
    reg = Registry(data_dir, keep_last=2)
    for n in (1, 2, 3):
        reg.create("acme", parent=f"acme@{n - 1}" if n > 1 else None, write=peft_writer, metrics={"reward": n / 10})
        reg.publish("acme", n, gate={"passed": True})
        write_dataset(data_dir, "train_steps", make_train_steps("acme", [n], version=f"acme@{n}"), file_id=f"s{n}")
    reg.create("acme", parent="acme@3", write=peft_writer, metrics={"reward": 0.05})
    reg.reject("acme", 4, reason="reward fell")
    reg.rollback("acme", 2)  # acme@5, a copy of acme@2; keep_last=2 retires acme@3? no: 2, 3 and 5 are published

    rows = {
        r["name"]: r
        for r in query(data_dir, "select name, status, latest, parent, reason, metric_reward from adapters").to_pylist()
    }
    assert {n: r["status"] for n, r in rows.items()} == {
        "acme@1": "retired",  # keep-last-2 at the third publish
        "acme@2": "retired",  # keep-last-2 when the rollback published acme@5
        "acme@3": "published",
        "acme@4": "rejected",
        "acme@5": "published",
    }
    assert rows["acme@5"]["latest"] and not rows["acme@3"]["latest"]
    assert rows["acme@5"]["parent"] == "acme@2" and rows["acme@5"]["metric_reward"] == pytest.approx(0.2)
    assert rows["acme@4"]["reason"] == "reward fell"

    reg.retire("acme", 5)
    latest = query(data_dir, "select name from adapters where latest").column("name").to_pylist()
    assert latest == ["acme@3"], "retiring the newest falls back to the previous published version"
    assert query(data_dir, "select gate->>'passed' as passed from adapters where name = 'acme@3'").to_pylist() == [
        {"passed": "true"}
    ]

    steps = query(
        data_dir,
        "select s.step, s.version, a.status from train_steps s join adapters a on a.name = s.version order by 1",
    ).to_pylist()
    assert steps == [
        {"step": 1, "version": "acme@1", "status": "retired"},
        {"step": 2, "version": "acme@2", "status": "retired"},
        {"step": 3, "version": "acme@3", "status": "published"},
    ]


def test_a_file_vanishing_while_the_views_are_listed_is_listed_again(data_dir, make_trajectories, monkeypatch):
    """Listing reads compacted files' footers; a compaction may delete one between the listing and the read."""
    import storage.query as query_module

    write_dataset(data_dir, "trajectories", make_trajectories(["a0", "a1", "a2"], "acme"), file_id="a")
    real, calls = query_module.live_files, []

    def vanishing_once(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            raise FileNotFoundError("compacted away meanwhile")
        return real(*args, **kwargs)

    monkeypatch.setattr(query_module, "live_files", vanishing_once)
    assert query(data_dir, "SELECT count(*) AS n FROM trajectories").column("n").to_pylist() == [3]


def test_bad_sql_raises_duckdb_error(data_dir):
    with pytest.raises(duckdb.Error, match="nope"):
        query(data_dir, "select * from nope")


def test_statement_without_result(data_dir):
    made = query(data_dir, "create table scratch (a int)")  # DuckDB answers a statement with an empty Count
    assert isinstance(made, pa.Table) and made.num_rows == 0 and made.column_names == ["Count"]
    assert query(data_dir, "select 1 as one").to_pylist() == [{"one": 1}]


def test_an_open_connection_blocks_no_writer(data_dir, make_trajectories, peft_writer):
    """Views are a snapshot of the file list; writers, compaction and the registry go on meanwhile."""
    from storage.compact import compact

    _fill(data_dir, make_trajectories)
    con = connect(data_dir)
    try:
        before = con.sql("select count(*) from trajectories").fetchall()
        write_dataset(data_dir, "trajectories", make_trajectories(["new"], "acme", start=99), file_id="new")
        compact(data_dir, grace_s=3600)  # merges, keeps the inputs (grace period) so `con` can still read them
        reg = Registry(data_dir)
        reg.create("acme", parent=None, write=peft_writer)
        reg.publish("acme", 1)
        assert con.sql("select count(*) from trajectories").fetchall() == before, "a snapshot"
    finally:
        con.close()
    assert query(data_dir, "select count(*) as n from trajectories").to_pylist() == [{"n": before[0][0] + 1}]
    assert query(data_dir, "select name from adapters where latest").to_pylist() == [{"name": "acme@1"}]


def test_a_data_dir_under_a_key_value_directory_adds_no_columns(tmp_path, make_trajectories):
    """Only the files' own columns: a `key=value` directory above the data dir (e.g. /data/run=3/) is not
    read as a partition (the tenant is a column of every file)."""
    data_dir = tmp_path / "run=3" / "tenant=x" / "data"
    write_dataset(data_dir, "trajectories", make_trajectories(["a", "b"], tenant="123"), file_id="f")
    write_dataset(data_dir, "trajectories", make_trajectories(["c"], tenant="acme"), file_id="f")
    columns = [row[0] for row in connect(data_dir).sql("describe trajectories").fetchall()]
    assert columns == SCHEMAS["trajectories"].names
    rows = query(data_dir, "select tenant, count(*) as n from trajectories group by 1 order by 1").to_pylist()
    assert rows == [{"tenant": "123", "n": 2}, {"tenant": "acme", "n": 1}]


def test_a_non_finite_metric_keeps_its_metric_column(data_dir, peft_writer):
    """The learner stores a non-finite metric as a string ("nan", "inf"): one diverged step must not drop
    metric_<key> from the adapters view for every version."""
    import math

    reg = Registry(data_dir)
    for loss in (0.5, 0.4):
        reg.create("acme", parent=None, write=peft_writer, metrics={"loss": loss, "mode": "logs"})
    reg.create("acme", parent=None, write=peft_writer, metrics={"loss": "nan", "mode": "logs"})
    reg.create("acme", parent=None, write=peft_writer, metrics={"loss": "-inf", "mode": "inf"})
    rows = query(data_dir, "select metric_loss, metric_mode from adapters order by number").to_pylist()
    assert [r["metric_loss"] for r in rows[:2]] == [0.5, 0.4]
    assert math.isnan(rows[2]["metric_loss"]) and rows[3]["metric_loss"] == -math.inf
    assert [r["metric_mode"] for r in rows] == ["logs", "logs", "logs", "inf"], "strings stay strings"


def test_latest_marks_what_serving_routes_to_even_while_that_versions_record_cannot_be_read(data_dir, peft_writer):
    """HEAD.json (what serving reads) still names acme@2 while its record is damaged; the view marked acme@1."""
    reg = Registry(data_dir)
    for _ in range(2):
        reg.publish("acme", reg.create("acme", parent=None, write=peft_writer).number)
    (data_dir / "registry" / "acme" / "2.json").write_text("{not json")
    rows = query(data_dir, "select name, latest from adapters order by number").to_pylist()
    assert rows == [{"name": "acme@1", "latest": False}]


def test_metric_keys_differing_only_in_case_do_not_shadow_one_another(data_dir, peft_writer):
    """DuckDB's names ignore case: metric_loss and metric_Loss were one column, with the second key's values."""
    reg = Registry(data_dir)
    reg.create("acme", parent=None, write=peft_writer, metrics={"loss": 1.0, "Loss": 2.0})
    table = query(data_dir, "select * from adapters")
    assert [c for c in table.column_names if c.lower() == "metric_loss"] == ["metric_loss"]  # the other: in metrics
    assert table.column("metric_loss").to_pylist() == [1.0]


def test_only_a_query_naming_adapters_reads_the_registry(data_dir, peft_writer, make_trajectories, monkeypatch):
    """Building the adapters view reads every registry record (a version per learner step, forever)."""
    from storage.registry import Registry as RealRegistry

    _fill(data_dir, make_trajectories)
    reg = Registry(data_dir)
    reg.create("acme", parent=None, write=peft_writer)
    reads = []
    real_get = RealRegistry.get

    def counting_get(self, tenant, number):
        reads.append((tenant, number))
        return real_get(self, tenant, number)

    monkeypatch.setattr(RealRegistry, "get", counting_get)
    assert query(data_dir, "select count(*) as n from trajectories").to_pylist() == [{"n": 14}]
    assert query(data_dir, "select 1 as one").to_pylist() == [{"one": 1}]
    assert reads == []
    views = query(data_dir, "select count(*) as n from duckdb_views() where not internal").to_pylist()
    assert views == [{"n": len(VIEWS)}] and reads == [], "every view exists; adapters, not named, is empty"
    assert query(data_dir, 'select name from main."ADAPTERS"').to_pylist() == [{"name": "acme@1"}]
    assert reads == [("acme", 1)]


def test_only_a_listed_file_that_vanished_is_retried(data_dir, make_trajectories, monkeypatch, tmp_path):
    """A compaction deleting a listed file is retried with a fresh listing; any other IO error is the
    statement's own and raised at once: running it again would repeat what it did before failing."""
    import storage.query as query_module

    write_dataset(data_dir, "trajectories", make_trajectories(["a0", "a1"], "acme"), file_id="a")
    write_dataset(data_dir, "trajectories", make_trajectories(["b0"], "acme", start=5), file_id="b")
    real, connects = query_module._connect, []

    def connect_then_compaction_deletes_b(*args, **kwargs):
        con, listed = real(*args, **kwargs)
        connects.append(listed)
        b = data_dir / "trajectories" / "tenant=acme" / "b.parquet"
        if b.exists():  # only once, after the first listing
            b.unlink()
        return con, listed

    monkeypatch.setattr(query_module, "_connect", connect_then_compaction_deletes_b)
    assert query(data_dir, "select count(*) as n from trajectories").to_pylist() == [{"n": 2}]
    assert len(connects) == 2

    connects.clear()
    side = tmp_path / "side.duckdb"
    sql = (f"ATTACH '{side}' AS side; CREATE TABLE side.log (n INT); INSERT INTO side.log VALUES (1); "
           f"SELECT * FROM read_csv('{tmp_path / 'typo.csv'}')")
    with pytest.raises(duckdb.IOException, match="typo.csv"):
        query(data_dir, sql)
    assert len(connects) == 1
    with duckdb.connect(str(side)) as con:
        assert con.sql("select count(*) from log").fetchall() == [(1,)], "the statement ran once"


def test_an_unreadable_registry_record_is_left_out_of_the_adapters_view(data_dir, peft_writer, make_trajectories, caplog):
    """A record damaged by hand, or written by a newer clora during a rolling upgrade, must not stop every
    query: the adapters view leaves it out, with a warning naming it."""
    import json
    import logging

    _fill(data_dir, make_trajectories)
    reg = Registry(data_dir)
    for _ in range(3):
        reg.create("acme", parent=None, write=peft_writer)
    record = json.loads((data_dir / "registry" / "acme" / "2.json").read_text())
    (data_dir / "registry" / "acme" / "2.json").write_text(json.dumps({**record, "format": 2}))
    (data_dir / "registry" / "acme" / "3.json").write_text("{not json")
    reg.create("acme", parent=None, write=peft_writer)
    four = json.loads((data_dir / "registry" / "acme" / "4.json").read_text())
    (data_dir / "registry" / "acme" / "4.json").write_text(json.dumps({**four, "metrics": [1, 2], "parent": 7}))
    with caplog.at_level(logging.WARNING, logger="storage.query"):
        assert query(data_dir, "select name from adapters").to_pylist() == [{"name": "acme@1"}]
        assert query(data_dir, "select count(*) as n from trajectories").to_pylist() == [{"n": 14}]
        assert connect(data_dir).sql("select count(*) from adapters").fetchall() == [(1,)]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings and all("acme@2" in w and "acme@3" in w and "acme@4" in w for w in warnings)


@pytest.mark.parametrize(("name", "sibling"), [("data?", "data1"), ("data*", "data-old"), ("data[12]", "data1")])
def test_a_data_dir_with_glob_characters_reads_only_its_own_files(tmp_path, make_trajectories, name, sibling):
    """DuckDB expands *, ? and [..] in every path read_parquet is given: a sibling matching the data dir's
    name as a pattern was read too (or, for [12], instead)."""
    write_dataset(tmp_path / name, "trajectories", make_trajectories(["a", "b"]), file_id="f1")
    write_dataset(tmp_path / sibling, "trajectories", make_trajectories(["x", "y", "z"]), file_id="f1")
    rows = query(tmp_path / name, "select id from trajectories order by id").column("id").to_pylist()
    assert rows == ["a", "b"]


def test_a_data_dir_under_home_is_expanded(tmp_path, data_dir, monkeypatch):
    """"~/..." (a TOML data_dir, a quoted env value) is the home directory's, not "<cwd>/~/..."."""
    from storage.layout import DataDir

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(data_dir)
    assert DataDir("~/clora-data").root == tmp_path / "clora-data"
