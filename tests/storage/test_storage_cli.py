"""storage.cli: `clora query`, `clora adapters ...` and `clora compact`, run through the real argparse tree."""

from __future__ import annotations

import csv
import io
import json

import pyarrow.parquet as pq
import pytest

from clora.cli import build_parser
from storage.parquet import live_files, read_dataset, write_dataset
from storage.registry import Registry

pytestmark = pytest.mark.unit


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

    code, _, err = clora("adapters", "show", "acme@9")
    assert code == 1 and "acme@9" in err
    code, _, err = clora("adapters", "retire", "acme")
    assert code == 1 and "tenant>@<number" in err


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
                late.append(True)
            return False
        return on_disk() == 1

    code, out, pid = compactor_loop(config, done)
    assert code == 0, out
    assert late, out
    assert "compactor stopped" in out
    assert ready_pid(data_dir / "state", "compactor") == pid
    assert sorted(read_dataset(data_dir, "trajectories").column("id").to_pylist()) == ["late", "x0", "x1", "x2", "x3"]
    assert len(list((data_dir / "trajectories" / "tenant=acme").glob("*.parquet"))) == 1
