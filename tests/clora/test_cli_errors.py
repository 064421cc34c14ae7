"""What the command line says when the set-up is wrong: a data directory it cannot use, a base model path
that is not a model, a broker that is not running, bad option values, a reader that stops reading. One
line naming the cause and a usage exit code (2), no traceback; Ctrl-C works while waiting."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_config import write_config  # tests/clora/test_config.py

from clora.cli import main

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens on it once the socket closes


@contextlib.contextmanager
def held_port():
    """A port another process holds (a socket of this one listens on it) for the `with` block."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


@pytest.mark.parametrize("command", [
    ["learn", "--once"], ["serve"], ["ingest", "--once"], ["model", "tiny"], ["compact"], ["compact", "--every", "5"],
    ["prune", "--older-than-days", "1"], ["adapters", "rollback", "acme@1"], ["adapters", "retire", "acme@1"],
])
def test_a_data_dir_under_a_file_is_one_line_for_every_command_that_writes_there(tmp_path, capsys, command):
    taken = tmp_path / "a-file"
    taken.write_text("")
    config = write_config(tmp_path, f'data_dir = "{taken / "data"}"\n')
    with pytest.raises(SystemExit) as e:
        main([*command, "--config", str(config)])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == f"clora: data_dir {taken / 'data'}: Not a directory"


def test_a_config_file_named_by_the_environment_says_so(tmp_path, capsys, monkeypatch):
    missing = tmp_path / "nosuch.toml"
    monkeypatch.setenv("CLORA_CONFIG", str(missing))
    with pytest.raises(SystemExit) as e:
        main(["config", "show"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == f"clora: config file {missing} (from $CLORA_CONFIG) does not exist"
    with pytest.raises(SystemExit):  # --config wins over the environment and is named as given
        main(["config", "show", "--config", str(tmp_path / "other.toml")])
    assert capsys.readouterr().err.strip() == f"clora: config file {tmp_path / 'other.toml'} does not exist"


def test_the_clora_script_imports_a_python_scorer_from_the_current_directory(tmp_path):
    """`python -m clora` (and `clora up`'s children) put the current directory on sys.path, the installed
    `clora` script does not: `clora config check` (and `clora ingest`, `clora learn`) failed on a scorer
    module next to clora.toml."""
    script = Path(sys.executable).with_name("clora")
    assert script.is_file(), f"no clora script beside {sys.executable}: is clora installed in this environment?"
    (tmp_path / "clora_cwd_scorer.py").write_text("def f(completion, prompt):\n    return 0.25\n")
    (tmp_path / "clora.toml").write_text(
        f'data_dir = "{tmp_path / "data"}"\n[[tenants]]\nname = "acme"\napi_key = "sk-acme-0001"\n'
        'scorer = "python:clora_cwd_scorer:f"\n')
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CLORA_CONFIG", "CLORA_DATA_DIR")}
    result = subprocess.run([str(script), "config", "check", "--config", "clora.toml"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert "ok       tenant acme: scorer python:clora_cwd_scorer:f builds" in result.stdout, result.stdout + result.stderr


def test_a_module_in_the_current_directory_named_as_a_clora_package_shadows_nothing(tmp_path):
    """A user's `ingest.py` (or `storage.py`, ...) beside clora.toml was imported instead of clora's own package:
    by `clora up`'s children (`python -m` puts the directory first) and by the `clora` script (a directory on
    sys.path comes before an editable install's finder). Its scorer modules there still import."""
    for name in ("clora", "ingest", "learner", "serving", "storage"):
        (tmp_path / f"{name}.py").write_text(f"raise SystemExit('the user\\'s {name}.py was imported')\n")
    (tmp_path / "clora_cwd_scorer.py").write_text("def f(completion, prompt):\n    return 0.25\n")
    (tmp_path / "clora.toml").write_text(
        f'data_dir = "{tmp_path / "data"}"\n[[tenants]]\nname = "acme"\napi_key = "sk-acme-0001"\n'
        'scorer = "python:clora_cwd_scorer:f"\n')
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CLORA_CONFIG", "CLORA_DATA_DIR")}
    script = Path(sys.executable).with_name("clora")
    from clora.up import stack_specs
    from clora.config import load_config

    (spec, *_), _ = stack_specs(load_config(tmp_path / "clora.toml", environ={}), str(tmp_path / "clora.toml"))
    child = spec.argv[: spec.argv.index("-m") + 1]  # how `clora up` starts its processes
    assert child == [sys.executable, "-P", "-m"]
    for argv in ([str(script), "config", "check"], [*child, "clora", "config", "check"]):
        result = subprocess.run([*argv, "--config", "clora.toml"], cwd=tmp_path, env=env, capture_output=True,
                                text=True, timeout=120)
        assert "was imported" not in result.stdout + result.stderr
        assert "ok       tenant acme: scorer python:clora_cwd_scorer:f builds" in result.stdout, result.stdout + result.stderr
    for package in ("ingest", "learner", "serving"):
        result = subprocess.run([*child, package, "--help"], cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0 and f"python -m {package}" in result.stdout, result.stderr


def test_only_a_python_scorers_module_is_imported_from_the_current_directory(tmp_path):
    """The current directory used to be searched (last) for every module any import asked for, so kafka-python's
    probe for an optional `snappy` ran a `snappy.py` there. Now it is searched only while a python scorer's
    module loads or the scorer runs, which still finds the modules beside it it imports then."""
    (tmp_path / "snappy.py").write_text("raise SystemExit('the snappy.py in the current directory was imported')\n")
    (tmp_path / "clora_cwd_helper.py").write_text("SCORE = 0.25\n")
    (tmp_path / "clora_cwd_later.py").write_text("SCORE = 0.5\n")
    (tmp_path / "clora_cwd_unrelated.py").write_text("raise SystemExit('imported from the current directory')\n")
    (tmp_path / "clora_cwd_scorer.py").write_text(
        "import clora_cwd_helper\n\ndef f(completion, prompt):\n    import clora_cwd_later\n"
        "    return clora_cwd_helper.SCORE + clora_cwd_later.SCORE\n")
    program = ("from clora.cli import keep_the_current_directory_off_the_path as keep\n"
               "keep()\n"
               "import kafka.codec\n"
               "from ingest.scorers import build_scorer\n"
               "print(build_scorer('python:clora_cwd_scorer:f')('a', 'b'))\n"
               "import importlib.util\n"
               "spec = importlib.util.find_spec('snappy')\n"
               "print(spec and spec.origin)\n"
               "print(importlib.util.find_spec('clora_cwd_unrelated'))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # `python -c` puts the current directory first on sys.path, as `python -m` does
    result = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    score, snappy, unrelated = result.stdout.split("\n")[:3]
    assert score == "0.75", result.stdout
    # None, or the installed python-snappy (one of kafka-python's codecs): never the file here
    assert not snappy.startswith(str(tmp_path)), "the snappy.py in the current directory is found"
    assert unrelated == "None", "a module in the current directory is found outside a scorer's import"


def test_the_data_dir_check_writes_a_file_and_leaves_none(tmp_path):
    from clora.cli import prepare_data_dir

    prepare_data_dir(tmp_path / "new" / "data")
    assert list((tmp_path / "new" / "data").iterdir()) == []


@pytest.mark.parametrize("command", [["learn", "--once"], ["serve"], ["up"]])
@pytest.mark.parametrize("kind, why", [
    ("missing", "does not exist"),
    ("not a model", "is not a model directory (it has no config.json)"),
    ("no weights", "has no weights (no *.safetensors or pytorch_model*.bin)"),
    ("no tokenizer", "has no tokenizer (no tokenizer.json, tokenizer_config.json, tokenizer.model)"),
])
def test_a_model_path_that_is_not_a_model_directory_is_one_line(tmp_path, capsys, command, kind, why):
    model = tmp_path / "model"
    if kind != "missing":
        model.mkdir()
    if kind in ("no weights", "no tokenizer"):
        (model / "config.json").write_text("{}")
    if kind == "no tokenizer":
        (model / "model.safetensors").write_bytes(b"")
    config = write_config(tmp_path, f'data_dir = "{tmp_path / "data"}"\n[model]\npath = "{model}"\n')
    with pytest.raises(SystemExit) as e:
        main([*command, "--config", str(config)])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == f"clora: model.path {model} {why}"


def test_learn_with_a_damaged_base_model_says_so_in_one_line(tmp_path, tiny_model, caplog):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "tokenizer.json").write_text('{"x": 1}')
    config = write_config(tmp_path, f'data_dir = "{tmp_path / "data"}"\n[model]\npath = "{model}"\n')
    with caplog.at_level("ERROR"):
        assert main(["learn", "--once", "--no-progress", "--config", str(config)]) == 2
    (error,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert error.startswith(f"clora learn: cannot load the base model from {model}: ")


def test_learn_with_its_metrics_port_taken_says_so_in_one_line(tmp_path, tiny_model, caplog):
    with held_port() as port:
        config = write_config(tmp_path, f'data_dir = "{tmp_path / "data"}"\n[model]\npath = "{tiny_model}"\n'
                                        f'[learner]\nmetrics_port = {port}\n')
        with caplog.at_level("ERROR"):
            assert main(["learn", "--once", "--no-progress", "--config", str(config)]) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors[0] == f"clora learn: learner.metrics_port {port} on 127.0.0.1: Address already in use"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "--port", "99999"], "argument --port: 99999 is not a port number (1-65535)"),
        (["broker", "--port", "x"], "argument --port: 'x' is not a port number"),
        (["learn", "--max-steps", "0"], "argument --max-steps: 0 must be at least 1"),
        (["ingest", "--max-seconds", "-5"], "argument --max-seconds: -5 must be a number above 0"),
        (["bench", "ingest", "--processes", "-1"], "argument --processes: -1 must be from 0 to 8"),
        (["bench", "ingest", "--processes", "9"], "argument --processes: 9 must be from 0 to 8"),
        (["bench", "ingest", "--events", "0"], "argument --events: 0 must be at least 1"),
        (["bench", "experiments", "--steps", "0"], "argument --steps: 0 must be at least 1"),
        (["bench", "experiments", "--kv-cache-gib", "-1"], "argument --kv-cache-gib: -1 must be a number of 0 or more"),
        (["bench", "swap", "--interval", "0"], "argument --interval: 0 must be a number above 0"),
        (["bench", "serving", "--repeats", "x"], "argument --repeats: 'x' is not a whole number"),
        (["bench", "learner", "--tenants", "-2"], "argument --tenants: -2 must be at least 1"),
        (["bench", "serving", "--tenants", "x"], "argument --tenants: 'x' is not a comma-separated list of whole numbers"),
        (["bench", "experiments", "--n", "0,8"], "argument --n: '0,8' must list counts of at least 1"),
        (["learn", "--shard", "2/2"], "argument --shard: a shard is K/N with 0 <= K < N (e.g. 0/2), got '2/2'"),
    ],
)
def test_bad_option_values_are_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_the_broker_with_a_host_that_does_not_resolve_is_one_line(tmp_path, capsys):
    config = write_config(tmp_path, f'data_dir = "{tmp_path / "data"}"\n')
    assert main(["broker", "--config", str(config), "--host", "999.0.0.1", "--port", str(closed_port())]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("clora broker: cannot listen on 999.0.0.1:") and "\n" not in err


def test_ingest_without_a_broker_says_so_in_one_line(tmp_path, monkeypatch, caplog):
    from clora.config import load_config
    from ingest import process

    monkeypatch.setattr(process, "KAFKA_WAIT_S", 1.0)
    monkeypatch.setattr(process, "tune_runtime", lambda: None)  # it freezes the test process's GC
    bootstrap = f"127.0.0.1:{closed_port()}"
    cfg = load_config(write_config(tmp_path, f'data_dir = "{tmp_path / "data"}"\n[kafka]\nbootstrap = "{bootstrap}"\n'),
                      environ={})
    assert _ingest_errors(process, cfg, caplog) == [f"clora ingest: cannot reach Kafka at {bootstrap} (kafka.bootstrap) within 1 s: {bootstrap}: "
                      f"Connection refused; is the broker running?"]


def test_ingest_waits_for_a_broker_no_longer_than_max_seconds(tmp_path, monkeypatch, caplog):
    """`clora ingest --max-seconds 2` with no broker ran the whole 30 s wait for Kafka."""
    from clora.config import load_config
    from ingest import process

    monkeypatch.setattr(process, "tune_runtime", lambda: None)
    bootstrap = f"127.0.0.1:{closed_port()}"
    cfg = load_config(write_config(tmp_path, f'data_dir = "{tmp_path / "data"}"\n[kafka]\nbootstrap = "{bootstrap}"\n'),
                      environ={})
    started = time.monotonic()
    errors = _ingest_errors(process, cfg, caplog, max_seconds=2)
    assert time.monotonic() - started < 25, "waited past --max-seconds, to its own 30 s wait"
    assert errors == [f"clora ingest: cannot reach Kafka at {bootstrap} (kafka.bootstrap) within 2 s: {bootstrap}: "
                      "Connection refused; is the broker running?"]


def test_ingest_with_its_metrics_port_taken_says_so_in_one_line(tmp_path, monkeypatch, caplog):
    """A second ingest on the same host with the same ingest.metrics_port (the scale-out README describes)."""
    from clora.config import load_config
    from ingest import process

    monkeypatch.setattr(process, "tune_runtime", lambda: None)
    with held_port() as port:
        cfg = load_config(write_config(tmp_path, f'data_dir = "{tmp_path / "data"}"\n[ingest]\nmetrics_port = {port}\n'),
                          environ={})
        errors = _ingest_errors(process, cfg, caplog)
    assert errors == [f"clora ingest: ingest.metrics_port {port} on 127.0.0.1: Address already in use"]


def test_an_ingest_members_metrics_port_taken_or_out_of_range_says_so_in_one_line(tmp_path, monkeypatch, caplog):
    """`--member K` serves on ingest.metrics_port + K: the error names both, and a K past the last port is
    the same one line (clora up's config check covers only the members it starts)."""
    from clora.config import load_config
    from ingest import process

    monkeypatch.setattr(process, "tune_runtime", lambda: None)
    with held_port() as port:
        cfg = load_config(write_config(tmp_path, f'data_dir = "{tmp_path / "data"}"\n[ingest]\nmetrics_port = {port - 2}\n'),
                          environ={})
        errors = _ingest_errors(process, cfg, caplog, member=2)
    assert errors == [f"clora ingest: ingest.metrics_port {port - 2} + member 2 (port {port}) on 127.0.0.1: "
                      "Address already in use"]
    caplog.clear()
    (error,) = _ingest_errors(process, cfg, caplog, member=70_000)
    assert error.startswith(f"clora ingest: ingest.metrics_port {port - 2} + member 70000 (port {port - 2 + 70_000}) "
                            "on 127.0.0.1: ")
    assert "65535" in error


def _ingest_errors(process, cfg, caplog, member=None, max_seconds=None) -> list[str]:
    """Runs ingest in this process, expecting exit 2; its ERROR lines. The signal handlers it installs are
    put back."""
    try:
        assert process.run(cfg, member=member, max_seconds=max_seconds) == 2
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    return [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]


def test_ingest_waiting_for_a_broker_stops_at_ctrl_c(tmp_path):
    """kafka-python's constructors block ~30 s on an unreachable bootstrap, deaf to signals."""
    config = write_config(tmp_path, f'data_dir = "{tmp_path / "data"}"\n[kafka]\nbootstrap = "127.0.0.1:{closed_port()}"\n')
    proc = subprocess.Popen([sys.executable, "-m", "clora", "ingest", "--config", str(config)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        while not any("waiting up to 30 s for Kafka" in line for line in lines):
            line = proc.stdout.readline()
            assert line, f"ingest exited before waiting: {''.join(lines)}"
            lines.append(line)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
        assert time.monotonic() - sent < 25, "stopped by its own 30 s wait, not by the signal"
        assert "ingest stopped before Kafka answered" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_output_cut_short_by_its_reader_is_not_an_error(tmp_path):
    """`clora config show | head -1`: the reader leaves; clora ends quietly (it raised BrokenPipeError)."""
    config = write_config(tmp_path, f'data_dir = "{tmp_path / "data"}"\n')
    r, w = os.pipe()
    os.close(r)  # a reader that has gone already
    try:
        done = subprocess.run([sys.executable, "-m", "clora", "config", "show", "--config", str(config)], cwd=REPO,
                              stdout=w, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(w)
    assert done.returncode == 0
    assert done.stderr == f"clora: config {config}: 0 tenants, data in {tmp_path / 'data'}\n"  # which file, no more


def test_model_tiny_force_replaces_only_a_model_clora_built(tmp_path, capsys):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("important")
    assert main(["model", "tiny", "--out", str(precious), "--force"]) == 1
    assert (precious / "notes.txt").read_text() == "important"
    assert "is not a model clora built" in capsys.readouterr().err
    assert main(["model", "tiny", "--out", str(precious)]) == 1  # no hint at a --force that would be refused
    err = capsys.readouterr().err
    assert "is not a model clora built" in err and "--force replaces it" not in err
    (tmp_path / "afile").write_text("x")
    assert main(["model", "tiny", "--out", str(tmp_path / "afile")]) == 1
    assert f"{tmp_path / 'afile'} is a file, not a directory" in capsys.readouterr().err
    built = tmp_path / "built"
    assert main(["model", "tiny", "--out", str(built)]) == 0
    assert main(["model", "tiny", "--out", str(built)]) == 1
    assert capsys.readouterr().err.strip().endswith("already exists (--force replaces it)")
    assert main(["model", "tiny", "--out", str(built), "--force"]) == 0


def _config_check(config, capsys) -> tuple[int, list[str], list[str]]:
    """`clora config check`'s exit code, its lines, and what its PROBLEM lines say."""
    code = main(["config", "check", "--config", str(config)])
    out = capsys.readouterr().out.splitlines()
    return code, out, [line.split("PROBLEM", 1)[1].strip() for line in out if "PROBLEM" in line]


def test_config_check_says_which_kafka_tls_file_cannot_be_read(tmp_path, capsys):
    (tmp_path / "ca.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    config = write_config(tmp_path, f"""data_dir = "{tmp_path / 'data'}"
[broker]
embedded = false
[kafka]
bootstrap = "127.0.0.1:{closed_port()}"
security_protocol = "SSL"
ssl_cafile = "{tmp_path / 'ca.pem'}"
ssl_certfile = "{tmp_path / 'client.pem'}"
ssl_keyfile = "{tmp_path / 'client.key'}"
""")
    code, out, problems = _config_check(config, capsys)
    assert code == 1 and f"  ok       kafka.ssl_cafile {tmp_path / 'ca.pem'} is readable" in out
    assert problems[:2] == [f"kafka.ssl_certfile {tmp_path / 'client.pem'}: No such file or directory",
                            f"kafka.ssl_keyfile {tmp_path / 'client.key'}: No such file or directory"]


@pytest.mark.parametrize("embedded", [False, True])
def test_config_check_tells_a_port_held_by_something_else_from_kafka(tmp_path, capsys, embedded):
    """A port that takes connections but answers no Kafka request (another service) passed as "Kafka answers";
    ingest then retried it for a minute."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        config = write_config(tmp_path, f"""data_dir = "{tmp_path / 'data'}"
[broker]
embedded = {str(embedded).lower()}
port = {port}
[kafka]
bootstrap = "127.0.0.1:{port}"
""")
        code, out, problems = _config_check(config, capsys)
    assert code == 1 and not any("Kafka answers" in line for line in out)
    assert [p for p in problems if "does not answer a Kafka request" in p] == [
        f"something takes connections at 127.0.0.1:{port} (kafka.bootstrap), but does not answer a Kafka request: "
        f"127.0.0.1:{port} took the connection but did not answer a Kafka request within 2s"]


def test_a_learner_device_this_host_lacks_is_one_line_and_config_check_finds_it(tmp_path, capsys, caplog):
    """`learner.device = "cuda"` on a host without CUDA was a 40-line assertion traceback from torch, and config
    check passed it."""
    import torch

    # cuda:99: past the count on a CUDA host too, so the check runs on any host
    config = write_config(tmp_path, f'data_dir = "{tmp_path / "data"}"\n[broker]\nembedded = false\n'
                                    f'[kafka]\nbootstrap = "127.0.0.1:{closed_port()}"\n[learner]\ndevice = "cuda:99"\n')
    said = ("learner.device is 'cuda:99', but this host has "
            + (f"{torch.cuda.device_count()} cuda device(s), numbered from 0" if torch.cuda.is_available() else
               "no cuda device torch can use (set it to auto or cpu)"))
    code, out, problems = _config_check(config, capsys)
    assert code == 1 and problems[0] == said
    assert main(["learn", "--once", "--config", str(config)]) == 2
    assert f"clora learn: {said}" in caplog.text


def test_config_check_lists_what_the_config_names_that_is_not_there(tmp_path, capsys):
    port = closed_port()
    config = write_config(tmp_path, f"""data_dir = "{tmp_path / 'data'}"
[model]
path = "{tmp_path / 'no-model'}"
[broker]
embedded = false
[kafka]
bootstrap = "127.0.0.1:{port}"
[[tenants]]
name = "acme"
api_key = "sk-acme-key-1"
scorer = "python:no_such_module_here:f"
[[tenants]]
name = "lab"
api_key = "sk-lab-key-12"
scorer = "regex:a+"
mode = "rollouts"
prompts_file = "{tmp_path / 'prompts.txt'}"
""")
    code, out, problems = _config_check(config, capsys)
    assert code == 1 and len(problems) == 4 and out[-1] == "4 problem(s)"
    assert problems[0] == f"model.path {tmp_path / 'no-model'} does not exist"
    assert problems[1].startswith("tenant acme: scorer python: cannot import module 'no_such_module_here'")
    assert problems[2].startswith(f"tenant lab: cannot read prompts_file {tmp_path / 'prompts.txt'}")
    assert problems[3].startswith("Kafka is not reachable at 127.0.0.1:") and "Connection refused" in problems[3]
    assert f"  ok       data_dir {tmp_path / 'data'} does not exist yet; clora creates it ({tmp_path} is writable)" in out
    assert not (tmp_path / "data").exists(), "a check creates nothing: a mistyped data_dir would stay made"

    (tmp_path / "prompts.txt").write_text("one\ntwo\n")
    fixed = config.read_text().replace("python:no_such_module_here:f", "digits").replace(
        f'path = "{tmp_path / "no-model"}"', "seed = 0").replace("embedded = false", f"embedded = true\nport = {port}")  # where kafka.bootstrap points
    config.write_text(fixed)
    assert main(["config", "check", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "prompts_file" in out and "has 2 prompts" in out and out.rstrip().endswith("all checks passed")


def test_config_check_warns_of_what_clora_up_warns_of_and_names_its_file(tmp_path, capsys):
    """`clora up` warns of a config without tenants (every API key gets 401) and of ingest processes beyond the
    partitions; `clora config check` passed it without a word, and never said which file it had read."""
    from clora.config import load_config
    from clora.up import setup_warnings

    port = closed_port()
    config = write_config(tmp_path, f'data_dir = "{tmp_path / "data"}"\n[broker]\nport = {port}\n'
                                    f'[kafka]\nbootstrap = "127.0.0.1:{port}"\npartitions = 2\n[ingest]\nprocesses = 3\n')
    assert main(["config", "check", "--config", str(config)]) == 0  # warnings, not problems
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"config {config}: 0 tenants, data in {tmp_path / 'data'}"
    warnings = setup_warnings(load_config(config, environ={}))
    assert len(warnings) == 2 and warnings[0].startswith("no tenants are configured: every API key gets 401")
    assert [line for line in out if line.startswith("  warning  ")] == [f"  warning  {w}" for w in warnings]
    assert "PROBLEM" not in "\n".join(out) and out[-1] == "all checks passed"


def test_config_check_warns_of_an_open_admin_surface_and_placeholder_keys(tmp_path):
    from clora.config import load_config
    from clora.up import setup_warnings

    tenants = '[[tenants]]\nname = "acme"\napi_key = "sk-acme-change-me"\n'
    config = write_config(tmp_path, f'[serving]\nhost = "0.0.0.0"\n{tenants}')
    warnings = setup_warnings(load_config(config, environ={}))
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("serving.host 0.0.0.0 is reachable from other hosts and serving.admin_key is unset")
    assert warnings[1] == 'tenant acme: api_key is the example\'s placeholder (it contains "change-me"): give each ' \
                          "tenant a secret key"
    assert setup_warnings(load_config(config, environ={"CLORA_ADMIN_KEY": "sk-admin-secret"})) == warnings[1:]
    config.write_text(f'[serving]\nhost = "0.0.0.0"\nadmin_key = "sk-admin-secret"\n{tenants.replace("change-me", "k3y-x9")}')
    assert setup_warnings(load_config(config, environ={})) == []
    # the embedded broker and the metrics endpoints have no key at all
    config.write_text(f'[broker]\nhost = "0.0.0.0"\n[ingest]\nmetrics_host = "0.0.0.0"\nmetrics_port = 9464\n'
                      f'[learner]\nmetrics_host = "0.0.0.0"\n{tenants.replace("change-me", "k3y-x9")}')  # no learner port
    broker, metrics = setup_warnings(load_config(config, environ={}))
    assert broker.startswith("broker.host 0.0.0.0 is reachable from other hosts, and the embedded broker has no auth")
    assert metrics.startswith("ingest.metrics_host 0.0.0.0 is reachable from other hosts")
    config.write_text(config.read_text().replace("[broker]", "[broker]\nembedded = false"))
    assert len(setup_warnings(load_config(config, environ={}))) == 1  # an external broker is its own matter


def test_config_check_warns_when_versions_are_deleted_while_their_samples_may_still_be_trained(tmp_path):
    """A version's files go once keep_versions newer ones are published; its samples are trained up to
    max_staleness versions later: past that, samples drawn otherwise than at temperature 1 trained uncorrected."""
    from clora.config import load_config
    from clora.up import setup_warnings

    config = write_config(tmp_path, '[learner]\nkeep_versions = 3\nmax_staleness = 4\n'
                                    '[[tenants]]\nname = "acme"\napi_key = "sk-acme-k3y-x9"\n')
    (warning,) = setup_warnings(load_config(config, environ={}))
    assert warning.startswith("learner.keep_versions = 3 is not more than learner.max_staleness = 4") and \
        warning.endswith("set keep_versions to at least 5")
    config.write_text(config.read_text().replace("keep_versions = 3", "keep_versions = 5"))
    assert setup_warnings(load_config(config, environ={})) == []


def test_config_show_names_its_file_on_stderr_and_prints_only_the_config_on_stdout(tmp_path, capsys, monkeypatch):
    import json

    config = write_config(tmp_path, f'data_dir = "{tmp_path / "data"}"\n[[tenants]]\nname = "acme"\n'
                                    'api_key = "sk-acme-key-1"\n')
    assert main(["config", "show", "--config", str(config)]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["tenants"][0]["name"] == "acme"  # stdout stays the config alone
    assert err == f"clora: config {config}: 1 tenant, data in {tmp_path / 'data'}\n"
    monkeypatch.chdir(tmp_path / "..")  # no ./clora.toml here
    monkeypatch.delenv("CLORA_CONFIG", raising=False)
    monkeypatch.setenv("CLORA_DATA_DIR", str(tmp_path / "data"))
    assert main(["config", "show"]) == 0
    assert capsys.readouterr().err == ("clora: config the built-in defaults (no --config, $CLORA_CONFIG or "
                                       f"./clora.toml): 0 tenants, data in {tmp_path / 'data'}\n")


def test_config_check_finds_an_embedded_broker_kafka_bootstrap_does_not_name(tmp_path, capsys):
    from ingest.broker import free_port

    port = free_port()
    config = write_config(tmp_path, f'data_dir = "{tmp_path / "data"}"\n[broker]\nport = {port}\n')
    assert main(["config", "check", "--config", str(config)]) == 1  # kafka.bootstrap: the default, 127.0.0.1:9092
    out = capsys.readouterr().out
    problems = [line.split("PROBLEM", 1)[1].strip() for line in out.splitlines() if "PROBLEM" in line]
    assert "starts the embedded broker there" not in out  # the ok line said the opposite of the problem
    assert problems == [f"kafka.bootstrap is '127.0.0.1:9092' but the embedded broker listens on 127.0.0.1:{port} "
                        "(broker.host, broker.port): set kafka.bootstrap to it, or broker.embedded = false to use "
                        "the Kafka at kafka.bootstrap"]


def test_config_check_finds_the_embedded_brokers_port_held_by_another_process(tmp_path, capsys):
    """`clora up` refuses to start the embedded broker on a port another process holds; the check passed it.
    (Held by a running Kafka: tests/ingest/test_broker.py.)"""
    with held_port() as port:
        (tmp_path / "data").mkdir()
        config = write_config(tmp_path, f'data_dir = "{tmp_path / "data"}"\n[broker]\nport = {port}\n'
                                        f'[kafka]\nbootstrap = "127.0.0.1:{port}"\n')
        assert main(["config", "check", "--config", str(config)]) == 1
    out = capsys.readouterr().out
    problems = [line.split("PROBLEM", 1)[1].strip() for line in out.splitlines() if "PROBLEM" in line]
    assert len(problems) == 1 and problems[0].startswith(f"something takes connections at 127.0.0.1:{port} "
                                                         "(kafka.bootstrap), but does not answer a Kafka request")
    assert f"data_dir {tmp_path / 'data'} is writable" in out


def test_config_check_finds_servings_port_held_by_another_process(tmp_path, capsys):
    """`clora up` refuses to start when serving.port is held; the check said "all checks passed"."""
    from ingest.broker import free_port

    with held_port() as port:
        config = write_config(tmp_path, f'data_dir = "{tmp_path / "data"}"\n[serving]\nport = {port}\n'
                                        f'[broker]\nport = {free_port()}\n')
        assert main(["config", "check", "--config", str(config)]) == 1
    problems = [line.split("PROBLEM", 1)[1].strip() for line in capsys.readouterr().out.splitlines() if "PROBLEM" in line]
    assert [p for p in problems if "serving.port" in p] == [
        f"port {port} on 127.0.0.1 is already in use by another process (perhaps an earlier clora still running): "
        "stop it, or set serving.port to a free port"]


def test_config_check_finds_serving_on_the_embedded_brokers_port(tmp_path, capsys):
    from ingest.broker import free_port

    port = free_port()
    config = write_config(tmp_path, f'data_dir = "{tmp_path / "data"}"\n[broker]\nport = {port}\n'
                                    f'[serving]\nport = {port}\n[kafka]\nbootstrap = "127.0.0.1:{port}"\n')
    assert main(["config", "check", "--config", str(config)]) == 1
    problems = [line.split("PROBLEM", 1)[1].strip() for line in capsys.readouterr().out.splitlines() if "PROBLEM" in line]
    assert problems == [f"serving.port and broker.port are both {port}, where serving and the embedded broker cannot "
                        "both listen: set serving.port to another port (or broker.port and kafka.bootstrap)"]


def test_the_bootstrap_is_read_as_kafka_python_reads_it():
    """A `PLAINTEXT://` prefix and a missing port (9092) are Kafka's own forms: read as unreachable for ever,
    they kept ingest from starting."""
    from ingest.broker import unreachable

    with held_port() as port:
        assert unreachable(f"PLAINTEXT://127.0.0.1:{port}") is None
        assert unreachable(f"127.0.0.1:{closed_port()},localhost:{port}") is None  # one answering is enough
    why = unreachable("127.0.0.1")
    assert why is None or why.startswith("127.0.0.1:9092: ")  # the default port (something may listen there)
    assert unreachable("no-such-host.invalid:9092").startswith("no-such-host.invalid:9092: ")  # the resolver's words


def test_a_broken_pipe_other_than_stdout_is_not_taken_for_a_reader_done(monkeypatch):
    """Only the reader of stdout leaving is a normal end; another broken pipe is a failure."""
    import clora.cli as cli

    def breaks(args):
        raise BrokenPipeError(32, "Broken pipe")

    parser = SimpleNamespace(parse_known_args=lambda argv: (argparse.Namespace(func=breaks, command="query"), []))
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    with pytest.raises(BrokenPipeError):  # stdout (pytest's capture) is fine: the pipe was another
        cli.main([])


@pytest.mark.parametrize("argv, usage, unknown", [
    (["query", "select 1", "--fromat", "csv"], "usage: clora query ", "--fromat csv"),
    (["adapters", "list", "--tenat", "x"], "usage: clora adapters list ", "--tenat x"),
    (["compact", "--dry-run"], "usage: clora compact ", "--dry-run"),
    (["--bogus"], "usage: clora ", "--bogus"),
])
def test_a_mistyped_option_is_refused_with_the_usage_of_the_command_it_was_given_to(capsys, argv, usage, unknown):
    """The top-level usage (`clora [-h] [--config FILE] COMMAND ...`) showed none of the options there are."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage) and err.rstrip().endswith(f"error: unrecognized arguments: {unknown}"), err


def test_kafka_pythons_word_that_records_were_lost_is_a_warning_and_its_chatter_is_not_shown(tmp_path):
    """kafka-python says at INFO that a fetch offset is out of range (the records were deleted by retention
    before ingest read them) or that a log was truncated; clora shows kafka-python's warnings only, so the
    loss went unsaid. Run in a process of its own: logging is configured once per process."""
    code = (
        "import logging\n"
        "from clora.cli import setup_logging\n"
        "setup_logging('INFO')\n"
        "log = logging.getLogger('kafka.consumer.fetcher')\n"
        "log.info('Fetch offset %s is out of range for topic-partition %s', 5, 'clora.interactions-0')\n"
        "log.info('Resetting offset for partition %s to offset %s.', 'clora.interactions-0', 9)\n"
        "logging.getLogger('kafka.conn').info('connecting to 127.0.0.1:9092')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "WARNING kafka.consumer.fetcher: Fetch offset 5 is out of range" in lines[0], lines


def test_every_command_raises_its_open_files_limit_to_the_hard_one(tmp_path):
    """The learner holds a lock file open per tenant: at a soft limit of 1,024, its 1,020th tenant made every
    open() of the process fail."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 64:
        pytest.fail(f"this machine's hard limit on open files is {hard}")
    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
        "from clora.cli import main\n"
        "sys.argv = ['clora', 'config', 'show']\n"
        "import clora.commands\n"
        "real = clora.commands.config_show\n"
        "def show(args):\n"
        "    real(args)\n"
        "    print('soft', resource.getrlimit(resource.RLIMIT_NOFILE)[0], file=sys.stderr)\n"
        "clora.commands.config_show = show\n"
        "sys.exit(main(['config', 'show']))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert done.returncode == 0, done.stderr
    raised = int(done.stderr.split("soft ")[1].split()[0])
    assert raised > 64 and (hard == resource.RLIM_INFINITY or raised == hard)


def test_a_ctrl_c_while_the_parser_is_built_is_exit_130_not_a_traceback(monkeypatch):
    import clora.cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(clora.cli, "build_parser", interrupted)
    assert main(["status"]) == 130


def test_a_base_model_of_another_recipe_under_trained_adapters_is_not_rebuilt(tmp_path, tiny_model, capsys):
    """The default base model is rebuilt when clora's recipe changes (another init std, say): adapters trained
    on the old build went on, unawares, on the new weights."""
    import shutil

    from clora.cli import base_model_dir
    from clora.config import Config
    from learner.tiny_model import MARKER_FILE

    data = tmp_path / "data"
    built = data / "models" / "tiny-0"
    shutil.copytree(tiny_model, built)
    cfg = Config(data_dir=data)
    assert base_model_dir(cfg) == built, "the current recipe's build is used as it is"
    marker = json.loads((built / MARKER_FILE).read_text())
    (built / MARKER_FILE).write_text(json.dumps({**marker, "init_std": 0.02}))  # an older clora's build
    (data / "registry" / "acme").mkdir(parents=True)  # adapters were trained on it
    before = {p.name: p.stat().st_mtime_ns for p in built.iterdir()}
    with pytest.raises(SystemExit) as e:
        base_model_dir(cfg)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"clora: the base model {built} was built by another clora") and "init_std 0.02" in err
    assert f'model.path = "{built}"' in err
    assert {p.name: p.stat().st_mtime_ns for p in built.iterdir()} == before, "nothing rebuilt"


def test_version_says_the_installed_release(capsys):
    from importlib import metadata

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"clora {metadata.version('clora')}"
