"""`clora model tiny|random` through the real argparse tree."""

from __future__ import annotations

import pytest

from clora.cli import build_parser
from learner.cli import MODEL_SHAPES
from learner.tiny_model import RANDOM_SHAPES, is_complete, read_marker

pytestmark = pytest.mark.unit


def run(argv: list[str]) -> int:
    args = build_parser(("learner.cli",)).parse_args(argv)
    return args.func(args)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """An empty working directory and environment, so no clora.toml or CLORA_* variable leaks in."""
    monkeypatch.chdir(tmp_path)
    for var in ("CLORA_CONFIG", "CLORA_DATA_DIR", "CLORA_MODEL_PATH", "CLORA_LOG_LEVEL"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def test_shape_choices_match_the_builder():
    assert set(MODEL_SHAPES) == set(RANDOM_SHAPES)


def test_tiny_defaults_to_the_data_dir_and_config_seed(workdir, capsys):
    (workdir / "clora.toml").write_text(f'data_dir = "{workdir / "data"}"\n[model]\nseed = 7\n')
    assert run(["model", "tiny"]) == 0
    out = workdir / "data" / "models" / "tiny-7"
    assert is_complete(out) and read_marker(out)["seed"] == 7
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == str(out)
    assert printed[1] == f"parameters: {read_marker(out)['parameters']:,}"


def test_tiny_with_out_refuses_an_existing_directory_without_force(workdir, capsys):
    out = workdir / "mine"
    assert run(["model", "tiny", "--out", str(out), "--seed", "2"]) == 0
    assert read_marker(out)["seed"] == 2
    assert run(["model", "tiny", "--out", str(out)]) == 1
    assert "--force" in capsys.readouterr().err
    assert run(["model", "tiny", "--out", str(out), "--force"]) == 0


def test_random_builds_the_named_shape(workdir, capsys):
    out = workdir / "r"
    assert run(["model", "random", "--shape", "tiny-test", "--out", str(out), "--dtype", "float32"]) == 0
    marker = read_marker(out)
    assert (marker["shape"], marker["dtype"]) == ("tiny-test", "float32")
    assert capsys.readouterr().out.splitlines()[0] == str(out)


def test_random_says_how_far_it_is_on_stderr(workdir, capsys):
    """A qwen3-4b build writes 7.5 GiB and printed nothing until it was done. Not a terminal here: a line per
    file written."""
    assert run(["model", "random", "--shape", "tiny-test", "--out", str(workdir / "r"), "--dtype", "float32"]) == 0
    parameters = read_marker(workdir / "r")["parameters"]
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"writing {parameters:,} random parameters (0.0 GiB in 1 file(s))")
    assert err[1] == "wrote model.safetensors (1 of 1; 0.0 of 0.0 GiB)"


def test_random_on_a_terminal_shows_a_bar(workdir, capsys, monkeypatch):
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    assert run(["model", "random", "--shape", "tiny-test", "--out", str(workdir / "r"), "--dtype", "float32"]) == 0
    err = capsys.readouterr().err
    assert "weights:" in err and "wrote model.safetensors" not in err


def test_random_into_a_place_it_cannot_write_names_out_not_its_temporary_name(workdir, capsys, monkeypatch):
    import tempfile

    def refused(prefix, dir):
        raise PermissionError(1, "Operation not permitted", f"{dir}/{prefix}ee_x1t_p")

    monkeypatch.setattr(tempfile, "mkdtemp", refused)
    out = workdir / "sys" / "x"
    assert run(["model", "random", "--shape", "tiny-test", "--out", str(out)]) == 1
    assert capsys.readouterr().err.strip() == f"clora model random: cannot write {out}: Operation not permitted"


def test_random_under_a_file_says_so(workdir, capsys):
    (workdir / "afile").write_text("")
    out = workdir / "afile" / "x"
    assert run(["model", "random", "--shape", "tiny-test", "--out", str(out)]) == 1
    assert capsys.readouterr().err.strip() == (f"clora model random: cannot write {out}: {workdir / 'afile'} is not "
                                               "a directory")


def test_random_on_a_full_disk_names_out_and_leaves_nothing_behind(workdir, capsys, monkeypatch):
    import safetensors.torch

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    out = workdir / "r"
    assert run(["model", "random", "--shape", "tiny-test", "--out", str(out)]) == 1
    assert capsys.readouterr().err.strip().endswith(f"clora model random: cannot write {out}: No space left on device")
    assert list(workdir.iterdir()) == []  # the temporary build is gone


def test_random_rejects_an_unknown_shape(workdir):
    with pytest.raises(SystemExit):
        run(["model", "random", "--shape", "llama-70b", "--out", str(workdir / "x")])


def test_clora_learns_signal_handler_takes_no_lock(tmp_path, monkeypatch):
    """A handler runs in the main thread between two of its bytecodes, perhaps while that thread holds a lock
    (threading.Event.wait's, in the learner's idle wait): threading.Event.set in the handler could deadlock."""
    import argparse
    from types import SimpleNamespace

    import learner.loop as loop_module
    from clora.config import Config
    from learner.__main__ import main_from_args
    from signal_support import handlers_restored, locks_taken_by_handler

    lock_calls = []

    def run(cfg, *, stop, **_kw):
        lock_calls.extend(locks_taken_by_handler())
        assert stop.is_set() and stop.wait(5)  # set: the wait returns at once
        return SimpleNamespace(tenants={})

    monkeypatch.setattr(loop_module, "run", run)
    monkeypatch.setattr("clora.cli.config_from_args", lambda *_a, **_k: Config(data_dir=tmp_path))
    monkeypatch.setattr("clora.cli.base_model_dir", lambda _cfg: tmp_path)
    args = argparse.Namespace(shard=None, once=False, until_idle=False, max_steps=None, no_progress=True,
                              config_path=None)
    with handlers_restored():
        assert main_from_args(args) == 0
    assert lock_calls == []
