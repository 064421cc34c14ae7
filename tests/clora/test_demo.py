"""clora demo's ending: a finished run gets a verdict; an interrupted one says so, shows partial figures and
exits with 130. The stack itself is replaced by stand-ins for `up` (no broker, no engine)."""

from __future__ import annotations

import inspect
import json
import os
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from clora import demo
from clora.simulate import Simulator
from clora.up import KILLED_WHILE_STOPPING

pytestmark = pytest.mark.unit

# The most requests the demo's simulated apps have awaiting answers at once (the demo keeps the simulator's
# default concurrency).
SIMULATOR_WORKERS = inspect.signature(Simulator).parameters["concurrency"].default


def figures(reward_last):
    return {"digits-app": {"preference": "digits", "requests": 40, "failed": 0, "versions_seen": ["base", "digits-app@1"],
                           "reward_base": 0.1, "reward_last": reward_last}}


def test_a_finished_run_gets_a_verdict(tmp_path, capsys):
    assert demo._report(figures(0.9), {}) == 0
    assert "every tenant improved" in capsys.readouterr().out
    assert demo._report(figures(0.1), {}) == 1


def test_an_interrupted_run_is_marked_partial_and_exits_130(tmp_path, capsys):
    assert demo._report(figures(0.9), {}, interrupted_after=42.4) == 130
    out = capsys.readouterr().out
    assert out.lstrip().startswith("demo: interrupted after 42s of simulated traffic; partial figures:")
    assert "digits-app" in out  # the partial figures are still shown
    assert "every tenant improved" not in out and "no verdict" in out


def write_fake_model(path):
    """What the demo's model.path check looks for (config, weights, tokenizer); nothing here loads it."""
    path.mkdir(exist_ok=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (path / name).write_text("{}")


def run_demo(tmp_path, fake_up, monkeypatch):
    from clora.config import Config

    monkeypatch.setattr("clora.up.up", fake_up)
    write_fake_model(tmp_path / "model")
    cfg = Config.model_validate({"data_dir": str(tmp_path / "data"), "model": {"path": str(tmp_path / "model")}})
    return demo.run_demo(cfg, minutes=1, rate=20, preferences=["digits"], seed=0, out_png=tmp_path / "demo.png")


def test_a_second_demo_on_one_data_dir_exits_2_and_leaves_the_first_ones_data(tmp_path, monkeypatch, capsys):
    """The second deleted <data_dir>/demo, the first one's live data, before anything else (each on free
    ports, so neither saw the other)."""
    from clora.demo import DEMO_LOCK
    from storage.files import FileLock

    live = tmp_path / "data" / "demo" / "data" / "trajectories"
    live.mkdir(parents=True)
    ups = []
    with FileLock(tmp_path / "data" / DEMO_LOCK):  # the first demo, running
        code = run_demo(tmp_path, lambda *a, **kw: ups.append(1) or 0, monkeypatch)
    assert code == 2 and ups == [] and live.is_dir()
    assert "another clora demo is running on" in capsys.readouterr().err


def test_a_demo_interrupted_before_the_traffic_started_exits_130(tmp_path, monkeypatch, capsys):
    code = run_demo(tmp_path, lambda *a, on_stop, **kw: on_stop() or 0, monkeypatch)  # Ctrl-C while starting
    assert code == 130
    assert "interrupted before the simulated traffic started" in capsys.readouterr().out


@pytest.mark.parametrize("up_code", [0, KILLED_WHILE_STOPPING], ids=["clean-stop", "a-child-killed-while-stopping"])
def test_a_demo_interrupted_during_the_traffic_reports_partial_figures_and_exits_130(tmp_path, monkeypatch, capsys,
                                                                                    up_code):
    """Killed while stopping (a third Ctrl-C, a child past its stop time), the stack ran all the same: the
    figures are the simulator's, in memory."""
    posted = threading.Event()
    posts = []

    class FakeRefusingServing(BaseHTTPRequestHandler):  # healthy, but refuses every request: the records are failures
        def do_GET(self):
            self._answer(200, {"status": "ok"})

        def do_POST(self):
            posts.append(time.monotonic())
            posted.set()
            self._answer(503, {"error": {"message": "stand-in", "type": "unavailable", "code": 503}})

        def _answer(self, status, body):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *_):
            pass

    after_stop = {}

    def fake_interrupted_up(cfg, config_path, *, until, on_stop, file_only, keep_fds):
        """Serves until the simulated traffic has begun, then stops as `up` does after Ctrl-C: on_stop, then
        the children's stop, which takes a while (and outlasts the simulation's own end here)."""
        assert file_only, "the demo's children must read its own file only"
        server = ThreadingHTTPServer((cfg.serving.host, cfg.serving.port), FakeRefusingServing)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            assert posted.wait(20), "the simulation never started"
            assert not until()
            on_stop()
            stopped = time.monotonic()
            # Serving still answers while the rest of the stack stops. The simulation ends once the stop is
            # decided (it would run on for the rest of its minute otherwise); once it has ended, every request it
            # sent has been answered, so `posts` is complete.
            deadline = stopped + 30
            while not until():
                assert time.monotonic() < deadline, "the simulation did not end once the stop was decided"
                time.sleep(0.05)
            after_stop["posts"] = sum(t > stopped for t in posts)
        finally:
            server.shutdown()
            server.server_close()
        return up_code

    assert run_demo(tmp_path, fake_interrupted_up, monkeypatch) == 130, "still an interrupted run, though it ended"
    # Requests already awaiting answers when the stop came may still arrive (the simulator's concurrency at
    # most); new ones (20 a second before the fix) must not be sent at all.
    assert after_stop["posts"] <= SIMULATOR_WORKERS, f"{after_stop['posts']} requests came after the stop"
    out = capsys.readouterr().out
    assert re.search(r"\ndemo: interrupted after \ds of simulated traffic; partial figures:\n", out)
    assert "digits-app" in out and "every tenant improved" not in out


def tenant_figures(reward_base, reward_last, versions=("base", "digits-app@1")):
    return {"preference": "digits", "requests": 40, "failed": 0, "versions_seen": list(versions),
            "reward_base": reward_base, "reward_last": reward_last}


def test_a_tenant_has_learned_halfway_from_its_base_reward_to_1():
    assert demo.learned({"a": tenant_figures(0.1, 0.56)})  # 0.1 + 0.5 * 0.9 = 0.55
    assert not demo.learned({"a": tenant_figures(0.1, 0.54)})  # improved (the verdict's bar), not learned
    assert not demo.learned({"a": tenant_figures(0.1, 0.9, versions=["base"])})  # no adapter answered
    assert not demo.learned({"a": tenant_figures(float("nan"), 0.9)})
    assert not demo.learned({"a": tenant_figures(0.1, 0.9), "b": tenant_figures(0.1, 0.2)})  # every tenant
    assert not demo.learned({})


class FakeLearningServing(BaseHTTPRequestHandler):
    """A stand-in for serving whose tenant has learned digits after its first 10 answers."""
    answered = 0

    def do_GET(self):
        self._answer(200, {"status": "ok"})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        if self.path.endswith("/feedback"):
            return self._answer(200, {"status": "ok"})
        n, FakeLearningServing.answered = FakeLearningServing.answered, FakeLearningServing.answered + 1
        text, version = ("no digits here", "tiny") if n < 10 else ("4 8 15 16 23 42", "digits-app@1")
        self._answer(200, {"id": f"chatcmpl-{n}", "object": "chat.completion", "created": 0, "model": "digits-app",
                           "choices": [{"index": 0, "finish_reason": "stop",
                                        "message": {"role": "assistant", "content": text}}]},
                     {"x-clora-adapter-version": version})

    def _answer(self, status, body, headers=()):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        for k, v in dict(headers).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_):
        pass


def fake_learning_up(cfg, config_path, *, until, on_stop, file_only, keep_fds):
    """Serves (FakeLearningServing) until the demo's traffic has ended, then stops as `up` does. The stack's
    processes are given the descriptor of the demo's lock, held (a demo killed outright leaves it held until
    they are gone)."""
    import fcntl

    (lock,) = keep_fds
    assert os.readlink(f"/proc/self/fd/{lock}").endswith("/demo.lock")
    other = os.open(f"/proc/self/fd/{lock}", os.O_RDONLY)  # the same file, another open file
    try:
        with pytest.raises(BlockingIOError):  # held: by the demo, through the descriptor given
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(other)
    server = ThreadingHTTPServer((cfg.serving.host, cfg.serving.port), FakeLearningServing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        deadline = time.monotonic() + 120
        while not until():
            assert time.monotonic() < deadline, "the simulation never ended"
            time.sleep(0.05)
        on_stop()
    finally:
        server.shutdown()
        server.server_close()
    return 0


@pytest.mark.parametrize("full", [False, True])
def test_the_traffic_stops_once_every_tenant_has_learned_unless_full(full, tmp_path, monkeypatch, capsys):
    from clora.config import Config

    FakeLearningServing.answered = 0
    monkeypatch.setattr(demo, "PROGRESS_SECONDS", 0.5)
    monkeypatch.setattr("clora.up.up", fake_learning_up)
    write_fake_model(tmp_path / "model")
    cfg = Config.model_validate({"data_dir": str(tmp_path / "data"), "model": {"path": str(tmp_path / "model")}})
    # The tenant has learned after some 15 answers (under a second at 20 a second): a run that stops then ends
    # far inside its minute, however loaded the machine; a full run takes all of its (here 9) seconds.
    minutes = 0.15 if full else 1.0
    code = demo.run_demo(cfg, minutes=minutes, rate=20, preferences=["digits"], seed=0,
                         out_png=tmp_path / "demo.png", full=full)
    out = capsys.readouterr().out
    assert code == 0 and "every tenant improved" in out, out
    assert ("stopping the traffic early" in out) is not full
    records = json.loads((tmp_path / "data" / "demo" / "records.json").read_text())
    last = max(r["t"] for r in records)
    if full:
        assert last >= minutes * 60 - 1, "a full run sends traffic for all of its minutes"
    else:
        assert last < minutes * 60 / 2, f"the traffic went on for {last:.1f}s, after the tenant had learned"


def test_a_plot_that_cannot_be_written_is_one_line_after_the_verdict(tmp_path, monkeypatch, capsys):
    """The figures and the verdict come first: a failing savefig (a full disk, the directory gone meanwhile)
    loses neither, nor the exit code."""
    from clora.config import Config

    def fails(records, tenants, out_png):
        raise OSError(28, "No space left on device")

    FakeLearningServing.answered = 0
    monkeypatch.setattr(demo, "PROGRESS_SECONDS", 0.5)
    monkeypatch.setattr(demo, "_plot", fails)
    monkeypatch.setattr("clora.up.up", fake_learning_up)
    write_fake_model(tmp_path / "model")
    cfg = Config.model_validate({"data_dir": str(tmp_path / "data"), "model": {"path": str(tmp_path / "model")}})
    code = demo.run_demo(cfg, minutes=0.15, rate=20, preferences=["digits"], seed=0, out_png=tmp_path / "demo.png")
    out, err = capsys.readouterr()
    assert code == 0 and "digits-app" in out and "every tenant improved" in out, out
    assert "reward over time" not in out
    assert err.strip() == (f"demo: cannot write the reward plot to {tmp_path / 'demo.png'}: OSError: [Errno 28] "
                           "No space left on device")


@pytest.mark.parametrize("argv, message", [
    (["--tenants", "digits,upper,digits"], "--tenants names digits more than once; give each preference once"),
    (["--tenants", "digits,bogus"], "unknown preference(s) bogus; choose from digits, upper, short, json"),
    (["--tenants", " , "], "--tenants names no preference; choose from digits, upper, short, json"),
    (["--out", "{tmp}/no-such-dir/demo.png"], "--out {tmp}/no-such-dir/demo.png: {tmp}/no-such-dir is not a directory"),
    (["--out", "{tmp}/demo.xyz"], "--out {tmp}/demo.xyz: the extension must be an image format matplotlib writes ("),
    (["--out", "{tmp}/demo"], "--out {tmp}/demo: the extension must be an image format matplotlib writes ("),
])
def test_demo_arguments_it_would_fail_on_are_usage_errors_before_anything_is_deleted(argv, message, tmp_path,
                                                                                     monkeypatch, capsys):
    """Found after the run (a duplicate tenant in the demo's config, savefig), they cost the minutes of the run
    and the previous demo's data, which the run deletes first."""
    from clora.cli import main

    monkeypatch.setattr(demo, "run_demo", lambda *a, **kw: pytest.fail("the demo must not start"))
    config = tmp_path / "clora.toml"
    config.write_text(f'data_dir = "{tmp_path / "data"}"\n')
    previous = tmp_path / "data" / "demo" / "records.json"
    previous.parent.mkdir(parents=True)
    previous.write_text("[]")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(["demo", "--config", str(config), *argv]) == 2
    assert capsys.readouterr().err.strip().startswith(f"clora demo: {message.replace('{tmp}', str(tmp_path))}")
    assert previous.exists()


@pytest.mark.parametrize("path", ['/tmp/a "quoted" dir', "C:\\Users\\me\\clora", "/tmp/caf\u00e9\x7f\ttab"])
def test_the_demo_config_holds_any_path(path):
    """Paths went into the TOML unescaped: a quote or a backslash made the demo's own config unreadable."""
    import tomllib
    from pathlib import Path

    text = demo.demo_config_text(Path(path) / "data", Path(path) / "model", 9092, 8000, ["digits"])
    parsed = tomllib.loads(text)
    assert parsed["data_dir"] == str(Path(path) / "data") and parsed["model"]["path"] == str(Path(path) / "model")


def test_a_data_dir_that_cannot_be_used_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    from clora.config import Config

    monkeypatch.setattr("clora.up.up", lambda *a, **kw: pytest.fail("the stack must not start"))
    taken = tmp_path / "a-file"
    taken.write_text("")
    cfg = Config.model_validate({"data_dir": str(taken), "model": {"path": str(tmp_path / "model")}})
    assert demo.run_demo(cfg, minutes=1, rate=1, preferences=["digits"], seed=0, out_png=tmp_path / "demo.png") == 2
    assert capsys.readouterr().err.strip() == f"clora: data_dir {taken}: Not a directory"


def test_a_model_path_that_is_not_a_model_is_one_line_before_the_stack_starts(tmp_path, monkeypatch, capsys):
    from clora.config import Config

    monkeypatch.setattr("clora.up.up", lambda *a, **kw: pytest.fail("the stack must not start"))
    cfg = Config.model_validate({"data_dir": str(tmp_path / "data"), "model": {"path": str(tmp_path / "model")}})
    with pytest.raises(SystemExit) as e:
        demo.run_demo(cfg, minutes=1, rate=1, preferences=["digits"], seed=0, out_png=tmp_path / "demo.png")
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == f"clora: model.path {tmp_path / 'model'} does not exist"
