"""`clora bench WHAT` (clora/bench.py) before and around a benchmark: an --out or --model that cannot be used
is one line and exit 2 before anything starts; a benchmark's known errors are one line naming it (2: bad
input, 1: a failure while it ran); a bug keeps its traceback. The benchmarks themselves are not run here."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
from test_config import write_config  # tests/clora/test_config.py

from clora.bench import BENCHMARKS, BenchError
from clora.cli import build_parser, main

pytestmark = pytest.mark.unit


def _never_run(args):
    raise AssertionError("the benchmark started")


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_an_out_that_is_a_file_is_one_line_before_the_benchmark_starts(tmp_path, capsys, monkeypatch, name):
    monkeypatch.setattr(importlib.import_module(BENCHMARKS[name][0]), "run", _never_run)
    taken = tmp_path / "afile"
    taken.write_text("")
    assert main(["bench", name, "--out", str(taken)]) == 2
    assert capsys.readouterr().err.strip() == f"clora bench {name}: --out {taken}: Not a directory"


def test_the_registry_bench_with_an_out_under_a_file_is_one_line(tmp_path, capsys):
    taken = tmp_path / "afile"
    taken.write_text("")
    assert main(["bench", "registry", "--history", "2", "--samples", "1", "--tenants", "1",
                 "--out", str(taken / "sub")]) == 2
    assert capsys.readouterr().err.strip() == f"clora bench registry: --out {taken / 'sub'}: Not a directory"


def test_out_is_created_before_the_benchmark_runs(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(importlib.import_module("storage.bench"), "run", lambda args: seen.append(Path(args.out).is_dir()))
    assert main(["bench", "registry", "--out", str(tmp_path / "new" / "out")]) == 0
    assert seen == [True]


@pytest.mark.parametrize("name", ["experiments", "learner"])
def test_a_model_that_is_not_there_is_one_line_before_anything_starts(tmp_path, capsys, monkeypatch, name):
    monkeypatch.setattr(importlib.import_module(BENCHMARKS[name][0]), "run", _never_run)
    missing = tmp_path / "nonexistent"
    assert main(["bench", name, "--model", str(missing), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == f"clora bench {name}: --model {missing} does not exist"


def test_experiments_with_a_missing_model_starts_no_broker(tmp_path, capsys, monkeypatch):
    import ingest.broker

    monkeypatch.setattr(ingest.broker, "EmbeddedBroker", _never_run)
    empty = tmp_path / "model"
    empty.mkdir()
    assert main(["bench", "experiments", "--model", str(empty), "--n", "1", "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == (f"clora bench experiments: --model {empty} is not a model directory "
                                               "(it has no config.json)")


@pytest.mark.parametrize("text, says", [
    ("{}", 'not an experiments.json of this benchmark (it has no "runs")'),
    ("[1, 2]", 'not an experiments.json of this benchmark (it has no "runs")'),
    ('{"runs": {"concurrent": {}, "alone": {}}}', "not an experiments.json of this benchmark (no 'steps')"),
    ("{not json", "not JSON: "),
])
def test_a_from_json_that_is_not_a_result_is_one_line_and_writes_nothing(tmp_path, capsys, text, says):
    old = tmp_path / "e.json"
    old.write_text(text)
    out = tmp_path / "out"
    assert main(["bench", "experiments", "--from-json", str(old), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"clora bench experiments: --from-json {old}: {says}") and "\n" not in err
    assert list(out.iterdir()) == []


def test_a_from_json_that_does_not_exist_is_one_line(tmp_path, capsys):
    missing = tmp_path / "nosuch.json"
    assert main(["bench", "experiments", "--from-json", str(missing), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == (f"clora bench experiments: --from-json {missing}: "
                                               "No such file or directory")


@pytest.mark.parametrize("error, code, line", [
    (BenchError("the learner exited with 1"), 1, "clora bench registry: the learner exited with 1"),
    (OSError(28, "No space left on device", "/x/registry.json"), 1,
     "clora bench registry: /x/registry.json: No space left on device"),
])
def test_a_known_failure_while_it_runs_is_one_line(tmp_path, capsys, monkeypatch, error, code, line):
    def fails(args):
        raise error

    monkeypatch.setattr(importlib.import_module("storage.bench"), "run", fails)
    assert main(["bench", "registry", "--out", str(tmp_path / "out")]) == code
    assert capsys.readouterr().err.strip() == line


def test_a_bug_keeps_its_traceback(tmp_path, monkeypatch):
    monkeypatch.setattr(importlib.import_module("storage.bench"), "run", lambda args: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        main(["bench", "registry", "--out", str(tmp_path / "out")])


# ---------------------------------------------------------------------------------------------------------
# The serving benchmarks make --out before they measure (an hour's results are not lost at the end)


def _args(tmp_path: Path, model: Path, *argv: str):
    config = write_config(tmp_path, f'data_dir = "{tmp_path / "data"}"\n[model]\npath = "{model}"\n')
    return build_parser().parse_args(["bench", *argv, "--config", str(config)])


def test_the_serving_bench_makes_out_before_it_measures(tmp_path, monkeypatch, tiny_model):
    from serving import bench
    from serving.cpu_lora import COMPILE_ENV, ENV

    monkeypatch.setenv(ENV, "clora")  # run() sets both; monkeypatch puts them back
    monkeypatch.setenv(COMPILE_ENV, "1")
    out = tmp_path / "out"
    args = _args(tmp_path, tiny_model, "serving", "--tenants", "1", "--out", str(out))
    seen = []

    async def measure(model_path, counts, args, dtype):
        seen.append(out.is_dir())
        return {mode: {1: 1.0} for mode in bench.MODES}

    monkeypatch.setattr(bench, "measure", measure)
    assert bench.run(args) == 0
    assert seen == [True]
    assert json.loads((out / "serving.json").read_text())["rows"][0]["tenants"] == 1


def test_the_swap_bench_makes_out_before_it_measures(tmp_path, monkeypatch, tiny_model):
    import ingest.broker
    from serving import bench_swap

    out = tmp_path / "out"
    args = _args(tmp_path, tiny_model, "swap", "--out", str(out))
    seen = []

    def broker(*a, **k):
        seen.append(out.is_dir())
        raise BenchError("stopped here")

    monkeypatch.setattr(ingest.broker, "EmbeddedBroker", broker)
    with pytest.raises(BenchError):
        bench_swap.run(args)
    assert seen == [True]
