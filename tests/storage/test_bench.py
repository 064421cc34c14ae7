"""`clora bench registry` runs end to end in a tiny configuration (this proves it works; it times nothing)."""

from __future__ import annotations

import argparse
import json

import pytest

from storage import bench

pytestmark = pytest.mark.unit


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="clora bench registry")
    parser.add_argument("--out")
    bench.add_arguments(parser)
    return parser.parse_args(argv)


def test_registry_bench_writes_its_table_json_and_plot(tmp_path, capsys):
    args = _parse("--history", "12,4", "--samples", "3", "--keep-last", "2", "--tenants", "2,5", "--out", str(tmp_path))
    assert bench.run(args) == 0
    result = json.loads((tmp_path / "registry.json").read_text())
    assert [r["history"] for r in result["rows"]] == [4, 12]
    for row in result["rows"]:
        for mode in ("hint", "no hint"):
            assert set(row[mode]) == {"step", "latest_published", "published"}
            assert all(s["median_ms"] > 0 for s in row[mode].values())
    assert [r["tenants"] for r in result["tenant_rows"]] == [2, 5]
    for row in result["tenant_rows"]:
        for mode in ("one entry", "rebuild"):
            assert set(row[mode]) == {"step", "published_after_change"}
            assert all(s["median_ms"] > 0 for s in row[mode].values())
    assert (tmp_path / "registry.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "| 12 |" in out and "| 5 |" in out


@pytest.mark.parametrize("argv, message", [
    (["--history", "abc"], "argument --history: 'abc' is not a comma-separated list of whole numbers"),
    (["--history", "10,1e3"], "argument --history: '10,1e3' is not a comma-separated list of whole numbers"),
    (["--history", "0,5"], "argument --history: '0,5': the sizes must be at least 1"),
    (["--history", ","], "argument --history: ',' names no size"),
    (["--samples", "0"], "argument --samples: 0 must be at least 1"),
    (["--keep-last", "0"], "argument --keep-last: 0 must be at least 1"),
    (["--keep-last", "x"], "argument --keep-last: 'x' is not a whole number"),
])
def test_registry_bench_bad_arguments_are_usage_errors(capsys, argv, message):
    """A usage error (exit 2) naming the option, before anything runs: --history abc was a ValueError
    traceback, --keep-last 0 one from the registry."""
    with pytest.raises(SystemExit) as exit_:
        _parse(*argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err
