"""storage.cli: `clora query`, `clora adapters ...` and `clora compact`, run through the real argparse tree."""

from __future__ import annotations

import csv
import io
import json
from datetime import datetime, timezone

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clora.cli import build_parser
from storage.parquet import live_files, read_dataset, write_dataset
from storage.registry import Registry

pytestmark = pytest.mark.unit

T0 = datetime(2025, 1, 1, tzinfo=timezone.utc)


@pytest.fixture
def clora(tmp_path, data_dir, monkeypatch, capsys):
    """Runs `clora <args>` (storage commands only) against data_dir; returns (exit code, stdout, stderr)."""
    config = tmp_path / "clora.toml"
    config.write_text(f'data_dir = "{data_dir}"\n[learner]\nkeep_versions = 2\n')
    monkeypatch.delenv("CLORA_DATA_DIR", raising=False)
    monkeypatch.setenv("CLORA_CONFIG", str(config))
    parser = build_parser(["storage.cli"])

    def run(*argv: str) -> tuple[int, str, str]:
        args = parser.parse_args(argv)
        code = args.func(args)
        out, err = capsys.readouterr()
        return code, out, err

    return run


def _fill(data_dir, make_trajectories):
    write_dataset(data_dir, "trajectories", make_trajectories(["a", "b"], "acme", reward=1.0), file_id="f1")
    write_dataset(data_dir, "trajectories", make_trajectories(["c"], "globex", reward=0.0), file_id="f1")


def test_query_prints_a_readable_table(clora, data_dir, make_trajectories):
    _fill(data_dir, make_trajectories)
    code, out, _ = clora("query", "select tenant, count(*) as n, avg(reward) as r from trajectories group by 1 order by 1")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["tenant", "n", "r"]
    assert lines[2].split() == ["acme", "2", "1"]
    assert lines[3].split() == ["globex", "1", "0"]
    assert lines[-1] == "(2 rows)"


@pytest.mark.parametrize("fmt", ["csv", "json", "parquet"])
def test_query_formats(clora, data_dir, make_trajectories, tmp_path, fmt):
    _fill(data_dir, make_trajectories)
    sql = "select id, tenant, ts from trajectories order by id"
    out_file = tmp_path / f"out.{fmt}"
    code, out, _ = clora("query", sql, "--format", fmt, "--out", str(out_file))
    assert code == 0 and out == ""
    if fmt == "csv":
        rows = list(csv.DictReader(io.StringIO(out_file.read_text())))
        assert [r["id"] for r in rows] == ["a", "b", "c"]
    elif fmt == "json":
        rows = json.loads(out_file.read_text())
        assert [r["id"] for r in rows] == ["a", "b", "c"] and rows[0]["ts"].startswith("2025-01-01")
    else:
        assert pq.read_table(out_file).column("id").to_pylist() == ["a", "b", "c"]


def test_query_json_to_stdout_and_errors(clora, data_dir):
    code, out, _ = clora("query", "select count(*) as n from feedback", "--format", "json")
    assert code == 0 and json.loads(out) == [{"n": 0}]
    code, _, err = clora("query", "select * from no_such_view")
    assert code == 1 and "no_such_view" in err
    code, _, err = clora("query", "select 1", "--format", "parquet")
    assert code == 2 and "--out" in err


def test_adapters_commands(clora, data_dir, peft_writer):
    reg = Registry(data_dir, keep_last=5)
    for n in (1, 2):
        reg.create("acme", parent=None, write=peft_writer, metrics={"reward": n / 10})
        reg.publish("acme", n)
    reg.create("globex", parent=None, write=peft_writer)

    code, out, _ = clora("adapters", "list", "--tenant", "acme")
    assert code == 0
    assert [line.split()[:2] for line in out.splitlines()[2:4]] == [["acme@1", "published"], ["acme@2", "published"]]
    code, out, _ = clora("adapters", "list")
    assert "globex@1" in out and "candidate" in out

    code, out, _ = clora("adapters", "show", "acme@2")
    shown = json.loads(out)
    assert code == 0 and shown["name"] == "acme@2" and shown["files_present"] and shown["metrics"] == {"reward": 0.2}

    code, out, _ = clora("adapters", "rollback", "acme@1")
    assert code == 0 and "acme@3" in out
    assert Registry(data_dir).latest_published("acme").parent == "acme@1"
    # keep_versions = 2 in the config: acme@1 was retired by the rollback's publish.
    assert Registry(data_dir).get("acme", 1).status == "retired"

    code, out, _ = clora("adapters", "retire", "acme@2")
    assert code == 0 and Registry(data_dir).get("acme", 2).status == "retired"
    assert out.strip() == "acme@2 retired; its files are deleted; acme is still served acme@3"

    code, _, err = clora("adapters", "show", "acme@9")
    assert code == 1 and "acme@9" in err


def test_retiring_the_version_served_says_what_the_tenant_is_served_now(clora, data_dir, peft_writer):
    """It said only "acme@3 retired; its files are deleted", leaving the operator to guess what acme got."""
    reg = Registry(data_dir, keep_last=5)
    for n in (1, 2, 3):
        reg.create("acme", parent=None, write=peft_writer)
        if n == 2:  # a rejected version is never served
            reg.reject("acme", n, reason="gate")
        else:
            reg.publish("acme", n)
    code, out, _ = clora("adapters", "retire", "acme@3")
    assert code == 0
    assert out.strip() == ("acme@3 retired; its files are deleted; acme is now served acme@1 (from serving's next "
                           "registry poll)")
    code, out, _ = clora("adapters", "retire", "acme@1")
    assert code == 0
    assert out.strip() == ("acme@1 retired; its files are deleted; acme is now served the base model (from "
                           "serving's next registry poll)")


@pytest.mark.parametrize("action, says", [
    ("list", "One line per adapter version that can still change"),
    ("show", "Every field of one adapter version's registry record as JSON"),
    ("rollback", "Copies an older version's files into a new newest published version"),
    ("retire", "Deletes a version's files; its record stays"),
])
def test_each_adapters_action_has_a_description(capsys, action, says):
    with pytest.raises(SystemExit) as e:
        build_parser(["storage.cli"]).parse_args(["adapters", action, "--help"])
    assert e.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert says in help_text


def test_compact_command(clora, data_dir, make_trajectories):
    for f in range(4):
        write_dataset(data_dir, "trajectories", make_trajectories([f"id{f}"], "acme", start=f), file_id=f"f{f}")
    code, out, _ = clora("compact", "--grace", "0")
    assert code == 0 and "compacted 4 files in 1 partition(s)" in out
    assert len(live_files(data_dir, "trajectories")) == 1
    assert len(list((data_dir / "trajectories" / "tenant=acme").glob("*.parquet"))) == 1


def test_adapters_list_shows_what_can_still_change_unless_all(clora, data_dir, peft_writer):
    reg = Registry(data_dir, keep_last=2)  # as the config says
    for n in range(1, 7):
        reg.create("acme", parent=None, write=peft_writer)
        reg.publish("acme", n)
    code, out, _ = clora("adapters", "list")
    assert code == 0
    names = [line.split()[0] for line in out.splitlines()[2:] if line.startswith("acme@")]
    assert names == ["acme@5", "acme@6"], "the two kept"
    assert "(4 older versions" in out and "--all" in out
    code, out, _ = clora("adapters", "list", "--all")
    assert [line.split()[0] for line in out.splitlines()[2:] if line.startswith("acme@")] == [f"acme@{n}" for n in range(1, 7)]
    assert "older versions" not in out


def test_adapters_list_counts_only_the_older_versions_all_would_list(clora, data_dir, peft_writer):
    """After retention deleted settled records, the count of those not shown is of the records left."""
    import os
    import time

    reg = Registry(data_dir, keep_last=2)
    for n in range(1, 7):
        reg.create("acme", parent=None, write=peft_writer)
        reg.publish("acme", n)
    old = time.time() - 3600
    for n in (1, 2):  # retired long ago: retention deletes their records
        os.utime(data_dir / "registry" / "acme" / f"{n}.json", (old, old))
    assert reg.prune("acme", before_s=time.time() - 60) == 2
    code, out, _ = clora("adapters", "list")
    assert code == 0 and "(2 older versions" in out, out
    code, out, _ = clora("adapters", "list", "--all")
    assert [line.split()[0] for line in out.splitlines()[2:] if line.startswith("acme@")] == [
        f"acme@{n}" for n in range(3, 7)]


def test_compact_every_runs_until_sigterm_and_marks_itself_ready(tmp_path, data_dir, make_trajectories, compactor_loop):
    from storage.files import ready_pid

    for k in range(4):
        write_dataset(data_dir, "trajectories", make_trajectories([f"x{k}"], "acme", start=k), file_id=f"f{k}")
    config = tmp_path / "loop.toml"
    config.write_text(f'data_dir = "{data_dir}"\n')
    late = []

    def on_disk() -> int:
        return len(list((data_dir / "trajectories" / "tenant=acme").glob("*.parquet")))

    def done(proc) -> bool:
        if not late:  # first: ready, and the four files merged into one; then a late file, merged by a later run
            merged = len(live_files(data_dir, "trajectories", "acme")) == 1 and on_disk() == 1
            if ready_pid(data_dir / "state", "compactor") == proc.pid and merged:
                write_dataset(data_dir, "trajectories", make_trajectories(["late"], "acme", start=9), file_id="late")
                late.append(proc.pid)
            return False
        return on_disk() == 1

    code, out, pid = compactor_loop(config, done)
    assert code == 0, out
    assert late, out
    assert "compactor stopped" in out
    assert pid == late[0]  # it was ready, and its clean stop took the mark away: `clora status` lists it no more
    assert not (data_dir / "state" / "ready" / "compactor.json").exists()
    assert sorted(read_dataset(data_dir, "trajectories").column("id").to_pylist()) == ["late", "x0", "x1", "x2", "x3"]
    assert len(list((data_dir / "trajectories" / "tenant=acme").glob("*.parquet"))) == 1


def test_the_compactor_loops_signal_handler_takes_no_lock(clora, data_dir, monkeypatch):
    """A handler runs in the main thread between two of its bytecodes, perhaps while that thread holds a lock
    (threading.Event.wait's): a handler taking the same lock deadlocks the loop (as in clora/up.py)."""
    from signal_support import handlers_restored, locks_taken_by_handler
    from storage import cli

    lock_calls, runs = [], []

    def compact_once(*_args):
        runs.append(True)
        if len(runs) == 1:  # SIGTERM during the first run; the loop stops before a second
            lock_calls.extend(locks_taken_by_handler())
        return 0

    monkeypatch.setattr(cli, "_compact_once", compact_once)
    with handlers_restored():
        code, out, _ = clora("compact", "--every", "0.2")
    assert code == 0 and "compactor stopped" in out
    assert not (data_dir / "state" / "ready" / "compactor.json").exists()  # marked ready, then cleared on the stop
    assert lock_calls == []
    assert len(runs) == 1, "the loop stopped on the signal"


def _fill_feedback(data_dir):
    fb = pa.table({"id": ["a"], "tenant": ["acme"], "ts": [T0], "score": [0.9], "source": ["thumbs"],
                   "kafka_topic": ["t"], "kafka_partition": [0], "kafka_offset": [1], "ingested_at": [T0]})
    write_dataset(data_dir, "feedback", fb, file_id="f1")


def test_query_repeated_column_names_keep_every_column(clora, data_dir, make_trajectories):
    """A join's `select *` or `select t.id, f.id` repeats names: every format keeps each column in place."""
    _fill(data_dir, make_trajectories)
    _fill_feedback(data_dir)
    sql = "select t.id, t.prompt, f.id, f.score from trajectories t join feedback f on t.id = f.id"
    code, out, err = clora("query", sql)
    assert code == 0, err
    assert out.splitlines()[0].split() == ["id", "prompt", "id", "score"]
    assert out.splitlines()[2].split() == ["a", "prompt", "a", "a", "0.9"]
    code, out, _ = clora("query", sql, "--format", "csv")
    assert code == 0 and list(csv.reader(io.StringIO(out))) == [["id", "prompt", "id", "score"], ["a", "prompt a", "a", "0.9"]]
    code, out, _ = clora("query", sql + " union all select 'x', 'p', 'y', 1", "--format", "json")
    assert code == 0 and json.loads(out) == [
        {"id": "a", "prompt": "prompt a", "id_1": "a", "score": 0.9},
        {"id": "x", "prompt": "p", "id_1": "y", "score": 1.0},
    ]
    code, out, _ = clora("query", "select 1 as id, 2 as id, 3 as id_1", "--format", "json")
    assert json.loads(out) == [{"id": 1, "id_2": 2, "id_1": 3}], "a suffix never takes another column's name"
    code, _, err = clora("query", sql, "--format", "parquet", "--out", str(data_dir / "dup.parquet"))
    import pyarrow.parquet as pq

    written = pq.read_table(data_dir / "dup.parquet")  # readable by name: the repeats renamed as in json
    assert code == 0 and written.column_names == ["id", "prompt", "id_1", "score"], err
    assert written.column("score").to_pylist() == [0.9]


def test_query_json_writes_null_for_nan_and_infinities(clora, data_dir):
    code, out, _ = clora(
        "query", "select 'nan'::double as n, 'inf'::double as i, ['-inf'::double, 1.5] as l, {'x': 'nan'::float} as s",
        "--format", "json",
    )
    assert code == 0 and "NaN" not in out and "Infinity" not in out
    assert json.loads(out) == [{"n": None, "i": None, "l": [None, 1.5], "s": {"x": None}}]


def test_query_errors_that_are_not_duckdbs_are_one_line(clora, data_dir, tmp_path, peft_writer):
    for fmt in ("csv", "parquet"):
        out = tmp_path / "no" / "dir" / f"x.{fmt}"
        code, _, err = clora("query", "select 1", "--format", fmt, "--out", str(out))
        # the file the user named, not the hidden one the result is written to first
        assert code == 1 and err.strip() == f"clora query: cannot write the result to {out}: No such file or directory"
    for fmt in ("table", "json"):
        code, _, err = clora("query", "select 'infinity'::date as d", "--format", fmt)
        assert code == 1 and "OverflowError" in err and len(err.strip().splitlines()) == 1

    Registry(data_dir).create("acme", parent=None, write=peft_writer)
    Registry(data_dir).create("acme", parent=None, write=peft_writer)
    (data_dir / "registry" / "acme" / "2.json").write_text("{not json")
    code, out, err = clora("query", "select count(*) as n from trajectories")
    assert code == 0 and out.splitlines()[2] == "0", "a damaged record does not stop queries"
    code, out, _ = clora("query", "select name from adapters")
    assert code == 0 and "acme@1" in out and "acme@2" not in out
    code, _, err = clora("adapters", "show", "acme@2")
    assert code == 1 and err.startswith("clora adapters show: registry file ") and "acme/2.json cannot be read" in err
    assert len(err.strip().splitlines()) == 1


def test_query_errors_from_duckdb_are_one_line_with_where(clora, data_dir):
    """DuckDB puts a LINE block with ^ marks under its parser and conversion errors: the line and the token
    it marks are kept on the message's line (counted as DuckDB counts columns: a tab takes none, CJK two)."""
    for sql, line, token in [
        ("selec 1", "line 1", None),  # a parser error names its token already
        ("select 1/'a'", "line 1", "'a'"),
        ("select '日本語' as x,\n\t 1/'a'", "line 2", "'a'"),
        ("select " + ", ".join(map(str, range(60))) + ", 1/'a', " + ", ".join(map(str, range(60))), "line 1", "'a'"),
    ]:
        code, _, err = clora("query", sql)
        assert code == 1 and len(err.strip().splitlines()) == 1, err
        assert "LINE" not in err and "^" not in err
        assert err.strip().endswith(f"({line})" if token is None else f'({line}, at "{token}")'), err
    code, _, err = clora("query", "select nocol from trajectories")  # candidates on a second line
    assert code == 1 and len(err.strip().splitlines()) == 1 and "Candidate bindings" in err


@pytest.mark.parametrize("damage", ["cut", "garbage", "page"])
def test_query_over_a_damaged_data_file_names_it_and_points_nowhere_into_the_views(clora, data_dir, make_trajectories,
                                                                                   damage):
    """DuckDB's pointer for a file it cannot read marks a token of clora's view SQL (read_parquet([...]), not
    of the user's statement: it is left out, and the file is named as damaged."""
    _fill(data_dir, make_trajectories)
    path = next(p for p in live_files(data_dir, "trajectories") if "acme" in p)
    good = open(path, "rb").read()
    bad = {"cut": good[:100], "garbage": b"\x01" * 3000,
           "page": good[:10] + b"x" * 20 + good[30:]}[damage]  # inside the first column's first page
    open(path, "wb").write(bad)
    code, _, err = clora("query", "select count(*) from trajectories")
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert path in err and "a damaged data file" in err and "read_parquet" not in err and "(line" not in err, err
    # Queries that do not read trajectories are not stopped by it (every one was: the views read every footer).
    for sql, first in (("select 42 x", "42"), ("select count(*) n from interactions", "0"),
                       ("select count(*) n from adapters", "0")):
        code, out, err = clora("query", sql)
        assert code == 0 and out.splitlines()[2] == first, (sql, err)


def test_query_of_a_missing_table_names_the_views(clora, data_dir):
    """DuckDB suggests the nearest name in its catalog, often one of its own tables (pg_enum) or clora's
    internal ones: those give way to the views; a suggestion that is a view stays."""
    views = "interactions, feedback, trajectories, dead_letters, train_steps, adapters"
    for sql in ("select * from nope", "select * from _clora_feedbac"):
        code, _, err = clora("query", sql)
        assert code == 1 and len(err.strip().splitlines()) == 1, err
        assert "Did you mean" not in err and views in err, err
    code, _, err = clora("query", "select * from trajectorie")
    assert code == 1 and err.strip().endswith('Did you mean "trajectories"?') and views not in err


def test_adapters_list_of_an_unknown_tenant_is_an_error(clora, data_dir, tmp_path, peft_writer, monkeypatch):
    """A typo must not look like a tenant without versions."""
    Registry(data_dir).create("acme", parent=None, write=peft_writer)
    code, _, err = clora("adapters", "list", "--tenant", "acmee")
    assert code == 1 and "'acmee' has no adapter versions" in err and "acme" in err
    code, out, _ = clora("adapters", "list", "--tenant", "acme")
    assert code == 0 and "acme@1" in out

    config = tmp_path / "tenants.toml"  # a configured tenant that has published nothing yet: 0 rows
    config.write_text(f'data_dir = "{data_dir}"\n[[tenants]]\nname = "globex"\napi_key = "k-globex"\n')
    monkeypatch.setenv("CLORA_CONFIG", str(config))
    code, out, _ = clora("adapters", "list", "--tenant", "globex")
    assert code == 0 and "(0 rows)" in out


def test_prune_and_compact_of_the_unknown_tenant_succeed(clora, data_dir):
    """Dead letters without a readable tenant (_unknown) have no adapters and no cursor: the registry and
    cursor steps are skipped (they rejected the name after the files were done, and the command failed)."""
    for k in range(2):
        dl = pa.table({"tenant": ["_unknown"], "reason": ["invalid_json"], "detail": ["x"], "raw": [b"{"],
                       "kafka_topic": ["t"], "kafka_partition": [0], "kafka_offset": [k], "ingested_at": [T0]})
        write_dataset(data_dir, "dead_letters", dl, file_id=f"f{k}")
    code, out, err = clora("compact", "--tenant", "_unknown", "--grace", "0")
    assert code == 0, err
    assert "compacted 2 files in 1 partition(s)" in out and len(live_files(data_dir, "dead_letters")) == 1
    code, out, err = clora("prune", "--older-than-days", "30", "--tenant", "_unknown")
    assert code == 0, err
    assert "deleted 1 files, 2 rows" in out and live_files(data_dir, "dead_letters") == []


def test_query_runs_exactly_one_statement(clora, data_dir):
    code, out, err = clora("query", "")
    assert (code, out, err.strip()) == (2, "", "clora query: no SQL statement given")
    code, out, err = clora("query", "select 1; select 2")
    assert (code, out, err.strip()) == (2, "", "clora query: give one SQL statement (got 2); run each on its own")
    code, out, _ = clora("query", "select 41 + 1 as n;", "--format", "json")  # one, with its semicolon
    assert code == 0 and json.loads(out) == [{"n": 42}]


def test_read_only_commands_say_when_the_data_dir_is_missing_or_not_a_directory(clora, data_dir, tmp_path,
                                                                                monkeypatch, capsys):
    data_dir.rmdir()
    code, out, err = clora("query", "select count(*) as n from trajectories", "--format", "json")
    assert code == 0 and json.loads(out) == [{"n": 0}]
    assert err.strip() == (f"clora: note: data_dir {data_dir} does not exist: nothing is stored there yet (is it the "
                           "data directory you meant? --config, CLORA_DATA_DIR)")
    code, _, err = clora("adapters", "list")
    assert code == 0 and "does not exist" in err
    assert not data_dir.exists(), "a read-only command must not create it"
    data_dir.write_text("a file")
    for argv in (["query", "select 1"], ["adapters", "list"], ["prune", "--older-than-days", "5", "--dry-run"]):
        with pytest.raises(SystemExit) as exit_:
            clora(*argv)
        assert exit_.value.code == 2
        assert capsys.readouterr().err.strip() == f"clora: data_dir {data_dir}: Not a directory", argv


@pytest.mark.parametrize("argv, wrong", [
    (["compact", "--dataset", "bogus"], "bogus"),
    (["prune", "--older-than-days", "5", "--dataset", "train_steps"], "train_steps"),  # not pruned
])
def test_an_unknown_dataset_is_a_usage_error_listing_the_choices(clora, capsys, argv, wrong):
    with pytest.raises(SystemExit) as exit_:
        clora(*argv)
    assert exit_.value.code == 2 and f"argument --dataset: invalid choice: '{wrong}'" in capsys.readouterr().err


def test_the_dataset_choices_are_the_storage_layouts():
    from storage import cli
    from storage.layout import DATASETS
    from storage.retention import PRUNED_DATASETS

    assert (cli.COMPACTED, cli.PRUNED) == (DATASETS, PRUNED_DATASETS)


@pytest.mark.parametrize("days", ["-1", "0", "nan", "inf"])
def test_prune_older_than_days_must_be_above_0(clora, data_dir, capsys, days):
    """A usage error naming the option, not "no retention" (the answer when neither it nor the config gives
    one) nor a traceback."""
    with pytest.raises(SystemExit) as exit_:
        clora("prune", f"--older-than-days={days}")
    assert exit_.value.code == 2
    assert f"argument --older-than-days: {days} must be a number above 0" in capsys.readouterr().err


def test_prune_older_than_days_past_what_a_timestamp_holds_is_a_usage_error(clora, data_dir, capsys, tmp_path):
    """1e305 days put the cutoff at minus infinity: a raw OverflowError from the command, and "pruning failed"
    on every compactor run when it came from the config."""
    with pytest.raises(SystemExit) as exit_:
        clora("prune", "--older-than-days=1e305", "--dry-run")
    assert exit_.value.code == 2
    assert "argument --older-than-days: 1e305 days is more than 100,000" in capsys.readouterr().err
    from clora.config import ConfigError, load_config

    config = tmp_path / "clora.toml"
    config.write_text("[retention]\ndays = 1e305\n")
    with pytest.raises(ConfigError, match="retention.days"):
        load_config(config, environ={})


@pytest.mark.parametrize("argv, message", [
    (["--every", "nan"], "argument --every: nan must be a number above 0"),  # compacted in a busy loop
    (["--every", "inf"], "argument --every: inf must be a number above 0"),  # an OverflowError after a run
    (["--every", "0"], "argument --every: 0 must be a number above 0"),
    (["--grace", "nan"], "argument --grace: nan must be a number of seconds, 0 or more"),  # deleted nothing
    (["--grace", "inf"], "argument --grace: inf must be a number of seconds, 0 or more"),
    (["--grace", "-1"], "argument --grace: -1 must be a number of seconds, 0 or more"),
])
def test_compact_every_and_grace_must_be_finite(clora, data_dir, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        clora("compact", *argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_compact_every_without_seconds_takes_the_configs_period(clora, data_dir, tmp_path, monkeypatch):
    """A deployment's compactor (compose.yaml) runs `clora compact --every` so that [compaction] every_seconds
    sets its period, as it does for `clora up`; with the period 0 (off) it is a usage error, not a busy loop."""
    from storage import cli

    periods = []
    monkeypatch.setattr(cli, "_compact_every", lambda cfg, args, grace: periods.append(args.every) or 0)
    config = tmp_path / "period.toml"
    config.write_text(f'data_dir = "{data_dir}"\n[compaction]\nevery_seconds = 42.5\n')
    monkeypatch.setenv("CLORA_CONFIG", str(config))
    assert clora("compact", "--every")[0] == 0
    assert clora("compact", "--every", "7")[0] == 0
    assert clora("compact", "--every", "--dataset", "feedback")[0] == 0
    assert periods == [42.5, 7.0, 42.5]

    missing = tmp_path / "not-yet"
    config.write_text(f'data_dir = "{missing}"\n[compaction]\nevery_seconds = 0\n')
    code, _, err = clora("compact", "--every")
    assert code == 2 and "[compaction] every_seconds, which is 0" in err
    assert periods == [42.5, 7.0, 42.5]
    assert not missing.exists(), "a refused command made the data dir"


def test_compact_and_prune_of_an_unknown_tenant_are_errors(clora, data_dir, make_trajectories, tmp_path, monkeypatch):
    """A typo must not look like a tenant with nothing to do (as in `adapters list`); a tenant with data but
    not in the config (removed from it, or created on the fly) and a configured one without data are fine."""
    _fill(data_dir, make_trajectories)  # acme and globex have data; neither is configured
    for command in (["compact"], ["prune", "--older-than-days", "30"]):
        code, _, err = clora(*command, "--tenant", "acmee")
        assert code == 1 and len(err.strip().splitlines()) == 1, err
        assert "'acmee' has no data and is not in the config" in err and "acme, globex" in err
        code, _, err = clora(*command, "--tenant", "acme")
        assert code == 0, err

    config = tmp_path / "tenants.toml"
    config.write_text(f'data_dir = "{data_dir}"\n[[tenants]]\nname = "initech"\napi_key = "k-initech"\n')
    monkeypatch.setenv("CLORA_CONFIG", str(config))
    for command in (["compact"], ["prune", "--older-than-days", "30"]):
        code, _, err = clora(*command, "--tenant", "initech")
        assert code == 0, err


def test_ctrl_c_interrupts_a_long_query_and_writes_no_out_file(tmp_path, data_dir):
    """DuckDB held the main thread, where Python runs its SIGINT handler, until the statement ended."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "result.csv"
    proc = subprocess.Popen(
        [sys.executable, "-m", "clora", "query", "--format", "csv", "--out", str(out),
         "select sum(a.range * b.range) from range(100000000) a, range(100000) b"],  # minutes of work
        env={**{k: v for k, v in os.environ.items() if k != "CLORA_CONFIG"}, "PYTHONPATH": str(repo),
             "CLORA_DATA_DIR": str(data_dir)},
        cwd=repo,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal's foreground job
    )
    try:
        # Running the statement: startup and the views take ~0.6 s of CPU; wait for 3 s of it.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            if (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") >= 3:
                break
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)
        started = time.monotonic()
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert err.strip() == "clora query: interrupted" and time.monotonic() - started < 10
    assert sorted(os.listdir(tmp_path)) == [data_dir.name], "no result file, no temporary one"


def test_an_interrupted_or_failed_out_file_write_leaves_the_previous_file(tmp_path, monkeypatch):
    import pyarrow.parquet as pq_module

    from storage.cli import write_table

    out = tmp_path / "result.parquet"
    write_table(pa.table({"x": [1]}), "parquet", str(out))

    def cut_short(table, f):
        f.write(b"PAR1 half")
        raise KeyboardInterrupt

    monkeypatch.setattr(pq_module, "write_table", cut_short)
    with pytest.raises(KeyboardInterrupt):
        write_table(pa.table({"x": [2]}), "parquet", str(out))
    assert pq.read_table(out).column("x").to_pylist() == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.parquet"]


def test_an_out_file_reached_by_a_link_is_replaced_through_it_keeping_its_permissions(tmp_path):
    """The link itself was renamed over (the file it named kept the old result), and a 0600 result came
    back 0644."""
    import os

    from storage.cli import write_table

    target = tmp_path / "results" / "secret.csv"
    target.parent.mkdir()
    target.write_text("old\n")
    target.chmod(0o600)
    link = tmp_path / "latest.csv"
    link.symlink_to(target)
    write_table(pa.table({"x": [1]}), "csv", str(link))
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text().splitlines() == ["x", "1"]
    assert target.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in target.parent.iterdir()) == ["secret.csv"]  # no hidden file left


def test_out_stdout_appends_where_the_shell_appends(tmp_path):
    """`clora query ... --out /dev/stdout >> log` opened the name again, which truncated the log. (Run with
    /dev/fd/1, the same stdout: code that renamed over the name could only fail there, not replace it.)"""
    import subprocess
    import sys
    from pathlib import Path

    from storage.cli import STDOUT_PATHS

    assert {"/dev/stdout", "/dev/fd/1", "/proc/self/fd/1"} <= set(STDOUT_PATHS)
    log = tmp_path / "log.csv"
    log.write_text("earlier\n")
    code = ("import pyarrow as pa; from storage.cli import write_table; "
            "write_table(pa.table({'x': [1]}), 'csv', '/dev/fd/1')")
    with open(log, "ab") as out:
        subprocess.run([sys.executable, "-c", code], stdout=out, check=True, cwd=Path(__file__).resolve().parents[2])
    assert log.read_text().splitlines() == ["earlier", "x", "1"]


def test_out_paths_in_or_through_dev_and_proc_are_written_in_place(tmp_path):
    """With stdout redirected to a file, /dev/stdout resolves to that file: renaming over it replaced the
    name /dev/stdout itself (as root), or failed to create a hidden file in /dev (as anyone else)."""
    from storage.cli import _written_in_place

    to_null = tmp_path / "to-null"
    to_null.symlink_to("/dev/null")
    assert _written_in_place("/dev/stdout") and _written_in_place("/proc/self/fd/1") and _written_in_place(str(to_null))
    assert not _written_in_place(str(tmp_path / "new.csv"))
    (tmp_path / "old.csv").write_text("x\n")
    assert not _written_in_place(str(tmp_path / "old.csv"))


def test_compact_goes_on_past_a_partition_that_fails_and_exits_1(clora, data_dir, make_trajectories, monkeypatch):
    from storage import compact

    for tenant in ("acme", "globex"):
        for k in range(2):
            rows = make_trajectories([f"{tenant}{k}"], tenant, start=k)
            write_dataset(data_dir, "trajectories", rows, file_id=f"f{k}")
    merge = compact._merge

    def fails_for_acme(dd, dataset, directory, batch):
        if directory.name == "tenant=acme":
            raise OSError(28, "No space left on device")
        return merge(dd, dataset, directory, batch)

    monkeypatch.setattr(compact, "_merge", fails_for_acme)
    code, out, err = clora("compact", "--grace", "0")
    assert code == 1
    assert "compacted 2 files in 1 partition(s)" in out and len(live_files(data_dir, "trajectories", "globex")) == 1
    assert "failed" not in out  # a failure is on stderr, with the summary that points at it
    assert err.splitlines() == ["trajectories/tenant=acme: failed: OSError: [Errno 28] No space left on device",
                                "clora compact: 1 failed: trajectories/tenant=acme (see above)"]


def test_compact_goes_on_past_a_dataset_it_cannot_list_and_exits_1(clora, data_dir, make_trajectories):
    import shutil

    feedback = data_dir / "feedback"
    if feedback.exists():
        shutil.rmtree(feedback)
    feedback.write_text("not a directory")
    for k in range(2):
        write_dataset(data_dir, "trajectories", make_trajectories([f"x{k}"], "acme", start=k), file_id=f"f{k}")
    code, out, err = clora("compact", "--grace", "0")
    assert code == 1
    assert "compacted 2 files in 1 partition(s)" in out and "failed" not in out
    failure, summary = err.splitlines()
    assert failure.startswith("feedback: failed: NotADirectoryError")
    assert summary == "clora compact: 1 failed: feedback (see above)"


def test_adapters_list_leaves_out_a_tenant_whose_record_cannot_be_read(clora, data_dir, peft_writer):
    reg = Registry(data_dir, keep_last=5)
    for tenant in ("acme", "globex"):
        reg.create(tenant, parent=None, write=peft_writer)
        reg.publish(tenant, 1)
    (data_dir / "registry" / "globex" / "1.json").write_text("{ edited by hand")
    code, out, err = clora("adapters", "list")
    assert code == 0 and "acme@1" in out and "globex@1" not in out
    assert "'globex' left out" in err and "1.json" in err
    code, _, err = clora("adapters", "list", "--tenant", "globex")
    assert code == 1 and "1.json" in err


@pytest.mark.parametrize("argv, message", [
    (["adapters", "show", "acme"], "argument version: 'acme' is not a version name; expected <tenant>@<number>"),
    (["adapters", "retire", "acme@-1"], "argument version: 'acme@-1' is not a version name"),
    (["adapters", "retire", "acme"], "argument version: 'acme' is not a version name"),
    (["adapters", "rollback", "acme@x"], "argument version: 'acme@x' is not a version name"),
    (["adapters", "show", "../x@1"], "argument version: tenant '../x' is not a valid tenant name"),
    (["adapters", "list", "--tenant", "../x"], "argument --tenant: tenant '../x' is not a valid tenant name"),
    (["compact", "--tenant", "../x"], "argument --tenant: tenant '../x' is not a valid tenant name"),
    (["prune", "--older-than-days", "30", "--tenant", "a b"], "argument --tenant: tenant 'a b' is not a valid"),
])
def test_a_malformed_version_or_tenant_is_a_usage_error_before_the_data_dir_is_touched(
        clora, data_dir, capsys, argv, message):
    """They were runtime errors (exit 1), and `rollback` and `retire` had created a missing data dir first."""
    data_dir.rmdir()
    with pytest.raises(SystemExit) as exit_:
        clora(*argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not data_dir.exists()


def test_commands_that_write_create_no_missing_data_dir(clora, data_dir):
    """Nothing is stored there, so there is nothing to roll back, retire, compact or prune: each says the data
    dir is missing, as a reading command does, and leaves no empty one (nor its lock files) behind."""
    data_dir.rmdir()
    _, _, note = clora("adapters", "list")
    assert note.startswith(f"clora: note: data_dir {data_dir} does not exist")
    for action in ("rollback", "retire"):
        code, out, err = clora("adapters", action, "acme@5")
        assert (code, out, err) == (1, "", note + f"clora adapters {action}: adapter version acme@5 does not exist\n")
        assert not data_dir.exists(), action
    for argv in (["compact"], ["compact", "--tenant", "_unknown", "--grace", "0"]):
        code, out, err = clora(*argv)
        assert (code, out, err) == (0, "compacted 0 files in 0 partition(s)\n", note), argv
        assert not data_dir.exists(), argv
    for argv in (["prune", "--older-than-days", "30"], ["prune", "--older-than-days", "30", "--tenant", "_unknown"]):
        code, out, err = clora(*argv)
        assert code == 0 and out.startswith("pruned (older than 30 days): deleted 0 files, 0 rows") and err == note
        assert not data_dir.exists(), argv


def test_retiring_or_rolling_back_a_version_that_does_not_exist_writes_nothing(clora, data_dir):
    """retire took the registry's lock before looking the version up, leaving locks/registry.lock."""
    for action in ("retire", "rollback"):
        code, _, err = clora("adapters", action, "acme@1")
        assert code == 1 and err.strip() == f"clora adapters {action}: adapter version acme@1 does not exist"
    assert list(data_dir.iterdir()) == []


def test_adapters_list_names_a_registry_folder_it_cannot_list_not_a_damaged_record(clora, data_dir, monkeypatch):
    registry = data_dir / "registry"

    def unreadable(self):
        raise PermissionError(13, "Permission denied", str(registry))

    monkeypatch.setattr(Registry, "tenants", unreadable)
    code, out, err = clora("adapters", "list")
    assert (code, out, err) == (1, "", f"clora adapters list: {registry}: Permission denied\n")


def _clora_process(config, *argv: str, prefix: tuple[str, ...] = ()):
    """`clora <argv> --config <config>` in a child process, as a user runs it: with its logging set up, so
    that what it logs to stderr (tracebacks) shows. Run from the config's folder: clora takes its current
    directory off sys.path, and this repository must stay on it. Returns (exit code, stdout, stderr)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLORA_")}
    proc = subprocess.run([*prefix, sys.executable, "-m", "clora", *argv, "--config", str(config)],
                          cwd=config.parent, env={**env, "PYTHONPATH": str(repo)}, capture_output=True, text=True,
                          timeout=60)
    return proc.returncode, proc.stdout, proc.stderr


def test_a_dataset_that_cannot_be_listed_is_one_line_on_stderr_without_a_traceback(tmp_path, data_dir):
    """It was an ERROR log line with a 12-line pyarrow traceback, and its `<dataset>: failed:` line went to
    stdout; the traceback is still logged at DEBUG."""
    (data_dir / "interactions").write_text("not a directory")
    config = tmp_path / "clora.toml"
    config.write_text(f'data_dir = "{data_dir}"\n')
    code, out, err = _clora_process(config, "compact")
    assert (code, out) == (1, "compacted 0 files in 0 partition(s)\n")
    failure, summary = err.splitlines()  # pyarrow's words for the error, once
    assert failure.startswith("interactions: failed: NotADirectoryError") and str(data_dir) in failure
    assert summary == "clora compact: 1 failed: interactions (see above)"
    for dry_run in ([], ["--dry-run"]):
        code, out, err = _clora_process(config, "prune", "--older-than-days", "30", *dry_run)
        assert code == 1 and out.startswith("pruned (older than 30 days)") and len(out.splitlines()) == 1
        assert err.splitlines() == [failure, "clora prune: pruning failed for 1: interactions (see above)"], dry_run

    config.write_text(f'data_dir = "{data_dir}"\nlog_level = "DEBUG"\n')
    code, _, err = _clora_process(config, "compact")
    assert code == 1 and "listing the tenants of interactions failed\nTraceback (most recent call last):" in err


def _without_permission_override() -> tuple[str, ...]:
    """A command prefix under which mode 000 denies access: none for a user; for root, setpriv dropping the
    capabilities that override file permissions (the test is skipped where that cannot be done)."""
    import os
    import shutil
    import subprocess

    if os.geteuid() != 0:
        return ()
    caps = "-dac_override,-dac_read_search"
    prefix = ("setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}", "--")
    if shutil.which("setpriv") is None or subprocess.run([*prefix, "true"], capture_output=True).returncode != 0:
        pytest.skip("running as root, and setpriv cannot drop the capabilities that override permissions")
    return prefix


def test_a_data_dir_that_cannot_be_read_is_one_line_and_exit_2_for_every_command(tmp_path, data_dir):
    """`prune --dry-run` printed four tracebacks and exited 1 where `prune` gave this line and exit 2, and
    `adapters list` blamed a damaged registry record."""
    prefix = _without_permission_override()
    config = tmp_path / "clora.toml"
    config.write_text(f'data_dir = "{data_dir}"\n')
    data_dir.chmod(0)
    try:
        for argv in (["prune", "--older-than-days", "30", "--dry-run"], ["prune", "--older-than-days", "30"],
                     ["compact"], ["adapters", "list"], ["adapters", "show", "acme@1"],
                     ["adapters", "retire", "acme@1"], ["query", "select count(*) from trajectories"]):
            code, out, err = _clora_process(config, *argv, prefix=prefix)
            assert (code, out, err) == (2, "", f"clora: data_dir {data_dir}: Permission denied\n"), argv
    finally:
        data_dir.chmod(0o755)


def test_status_says_each_tenants_served_version_learner_state_and_backlog(clora, data_dir, make_trajectories,
                                                                           peft_writer):
    from storage.files import mark_ready

    _fill(data_dir, make_trajectories)  # acme: 2 untrained, globex: 1
    reg = Registry(data_dir)
    reg.publish("acme", reg.create("acme", parent=None, write=peft_writer).number)
    (data_dir / "state" / "learner").mkdir(parents=True)
    (data_dir / "state" / "learner" / "status.json").write_text(json.dumps({
        "acme": {"status": "published", "step": 3, "error": None, "last": {"reward_mean": 0.25, "ts": "2026-12-07T08:00:00"}},
        "globex": {"status": "error", "step": 1, "error": "RuntimeError: scorer down", "last": {}},
    }))
    mark_ready(data_dir / "state", "learner")  # this test's own pid: running
    (data_dir / "state" / "ready" / "ingest.json").write_text(json.dumps({"pid": 2**22 + 12345, "at": 0}))

    code, out, _ = clora("status")
    assert code == 1, "globex's last step failed"
    lines = out.splitlines()
    assert lines[0] == f"data_dir {data_dir}"
    assert "ingest (pid 4206649, not running, no clean stop" in lines[1] and "learner (pid" in lines[1] and ", running, ready" in lines[1]
    table = [line.split() for line in lines[3:6]]
    assert table[0] == ["TENANT", "SERVED", "LEARNER", "STEP", "REWARD", "BACKLOG", "ERROR"]
    assert table[1] == ["acme", "*", "acme@1", "published", "3", "0.250", "2"]
    assert table[2] == ["globex", "*", "base", "error", "1", "-", "1", "RuntimeError:", "scorer", "down"]
    assert "* not in the config" in out

    code, out, _ = clora("status", "--json")
    report = json.loads(out)
    assert [(t["tenant"], t["served"], t["backlog"], t["configured"]) for t in report["tenants"]] == [
        ("acme", "acme@1", 2, False), ("globex", None, 1, False)]
    assert report["problems"] == []


def test_status_of_an_empty_data_dir_says_there_is_nothing(clora):
    code, out, _ = clora("status")
    assert code == 0 and "processes: none marked ready" in out and "(no tenants" in out


def test_status_exits_1_when_a_status_file_cannot_be_read(clora, data_dir):
    """It exited 0 (healthy, to a cron check) while the unreadable file might say a tenant fails."""
    learner = data_dir / "state" / "learner"
    learner.mkdir(parents=True)
    (learner / "status.json").write_text('{"acme": {"status": "err')  # damaged
    code, out, _ = clora("status")
    assert code == 1 and "problem: " in out and "status.json cannot be read" in out


def test_status_names_a_damaged_trajectories_file_whose_rows_training_leaves_out(clora, data_dir, make_trajectories):
    _fill(data_dir, make_trajectories)  # acme: 2 untrained, globex: 1
    (bad, *_) = sorted((data_dir / "trajectories" / "tenant=acme").glob("*.parquet"))
    bad.write_bytes(bad.read_bytes()[:60])  # truncated: it will never read
    code, out, _ = clora("status")
    assert code == 1 and f"problem: trajectories of acme left out of training, their file damaged: {bad}" in out, out


def test_status_takes_each_tenants_entry_from_the_status_file_written_last(clora, data_dir):
    """A shard file of an earlier learner layout is never deleted: read first, its old error made every
    later `clora status` exit 1. And a NaN reward is null in --json (strict JSON readers refuse NaN)."""
    import os

    learner = data_dir / "state" / "learner"
    learner.mkdir(parents=True)
    (learner / "status-0-of-2.json").write_text(json.dumps({"acme": {"status": "error", "step": 3, "error": "old"}}))
    os.utime(learner / "status-0-of-2.json", (1_000_000, 1_000_000))
    (learner / "status.json").write_text('{"acme": {"status": "idle", "step": 90, "error": null, '
                                         '"last": {"reward_mean": NaN}}, "beta": {"status": "idle", "last": [1]}}')
    code, out, _ = clora("status", "--json")
    report = json.loads(out)
    assert code == 0 and "NaN" not in out
    assert [(t["tenant"], t["status"], t["step"], t["reward_mean"]) for t in report["tenants"]] == [
        ("acme", "idle", 90, None), ("beta", "idle", None, None)]
