"""`clora bench registry` runs end to end in a tiny configuration (this proves it works; it times nothing)."""

from __future__ import annotations

import argparse
import json

import pytest

from storage import bench

pytestmark = pytest.mark.unit


def test_registry_bench_writes_its_table_json_and_plot(tmp_path, capsys):
    args = argparse.Namespace(history="12,4", samples=3, keep_last=2, out=str(tmp_path))
    assert bench.run(args) == 0
    result = json.loads((tmp_path / "registry.json").read_text())
    assert [r["history"] for r in result["rows"]] == [4, 12]
    for row in result["rows"]:
        for mode in ("hint", "no hint"):
            assert set(row[mode]) == {"step", "latest_published", "published"}
            assert all(s["median_ms"] > 0 for s in row[mode].values())
    assert (tmp_path / "registry.png").stat().st_size > 0
    assert "| 12 |" in capsys.readouterr().out


def test_registry_bench_refuses_bad_sizes(tmp_path):
    args = argparse.Namespace(history="0,5", samples=3, keep_last=2, out=str(tmp_path))
    assert bench.run(args) == 2
