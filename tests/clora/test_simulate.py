"""Simulated user preferences and the per-tenant summary (pure logic); the traffic against a stand-in for the
serving tier (an HTTP server in a thread) or a listener that never answers."""

import json
import math
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from clora.simulate import (
    Record,
    SimTenant,
    likes_digits,
    likes_json,
    likes_short_answers,
    likes_upper_case,
    summarise,
)

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def test_preferences_by_hand():
    assert likes_digits("a1 b2") == pytest.approx(2 / 4)  # spaces are ignored: a,1,b,2
    assert likes_digits("") == 0.0
    assert likes_upper_case("ABc d") == pytest.approx(2 / 4)
    assert likes_short_answers("hello") == 1.0
    assert likes_short_answers("x" * 42) == pytest.approx(1 - 30 / 100)
    assert likes_short_answers("x" * 112) == pytest.approx(0.0)
    assert likes_short_answers("x" * 200) == 0.0
    assert likes_json('{"a": 1}') == 1.0
    assert likes_json("[1, 2]") < 1.0  # valid JSON but not an object
    assert likes_json("plain words") == 0.0
    assert 0.3 <= likes_json('{"a": ') < 1.0


def test_summary_windows_and_versions():
    t = SimTenant("a", "k" * 8, "digits")
    recs = [Record(i, "a", f"r{i}", "base" if i < 4 else "a@1", i / 10, "", True) for i in range(8)]
    recs.append(Record(9, "a", "", "", 0.0, "", False, "boom"))
    s = summarise(recs, [t], window=0.25)["a"]
    assert s["requests"] == 9 and s["failed"] == 1
    assert s["reward_base"] == pytest.approx((0.0 + 0.1 + 0.2 + 0.3) / 4)  # the base model's answers
    assert s["reward_last"] == pytest.approx((0.6 + 0.7) / 2)
    assert s["versions_seen"] == ["base", "a@1"]
    # Without a base-model answer (every one came from an adapter): the first window.
    adapted = [Record(i, "a", f"r{i}", "a@1", i / 10, "", True) for i in range(8)]
    assert summarise(adapted, [t], window=0.25)["a"]["reward_base"] == pytest.approx((0.0 + 0.1) / 2)
    empty = summarise([], [t])["a"]
    assert empty["requests"] == 0 and math.isnan(empty["reward_base"])


def test_the_base_models_answers_are_those_without_a_version_whatever_its_name():
    """model.name need not be "base": any label without "@" is the base model's."""
    t = SimTenant("a", "k" * 8, "digits")
    recs = [Record(i, "a", f"r{i}", "qwen3-4b" if i < 2 else "a@1", 0.1 if i < 2 else 0.9, "", True) for i in range(8)]
    assert summarise(recs, [t], window=0.5)["a"]["reward_base"] == pytest.approx(0.1)


def test_a_failure_other_than_the_apis_is_counted_and_logged_once(monkeypatch, caplog):
    """Without the openai package (or on any bug) every request raised in its pool future, unseen: the run
    sent nothing and said nothing."""
    import sys

    from clora.simulate import Simulator

    monkeypatch.setitem(sys.modules, "openai", None)  # import openai fails
    sim = Simulator("http://127.0.0.1:9", [SimTenant("a", "k" * 8, "digits"), SimTenant("b", "k" * 9, "upper")],
                    rate=40, duration=0.3)
    with caplog.at_level("ERROR", logger="clora.simulate"):
        records = sim.run()
    assert len(records) >= 4 and not any(r.ok for r in records)
    assert all(r.error.startswith("ModuleNotFoundError") and "openai" in r.error for r in records)
    assert len([r for r in caplog.records if r.levelname == "ERROR"]) == 1
    s = summarise(records, sim.tenants)
    assert s["a"]["failed"] == s["a"]["requests"] > 0


def simulate_config(tmp_path):
    p = tmp_path / "clora.toml"
    p.write_text(f'data_dir = "{tmp_path / "data"}"\n[[tenants]]\nname = "digits-app"\napi_key = "sk-digits-0000"\n')
    return str(p)


def test_simulate_exits_1_when_a_tenant_had_no_request_succeed(tmp_path, capsys):
    """Serving answers, but never with success (a key it does not know): exit 1, naming the tenant and why."""
    from clora.cli import main

    with stand_in_serving(status=401) as url:
        code = main(["simulate", "--config", simulate_config(tmp_path), "--url", url, "--seconds", "0.3",
                     "--rate", "10"])
    assert code == 1
    err = capsys.readouterr().err
    assert "no request succeeded for digits-app (e.g. Error code: 401" in err


def test_simulate_stops_at_once_when_nothing_listens_naming_the_url_and_the_cause(tmp_path, capsys, caplog):
    """Nothing listening at the URL: it ran all of --seconds (60 s by default), logging `request for acme failed:
    Connection error.` four times a second, then exited 1; no line named the URL or the cause."""
    from clora.cli import main
    from ingest.broker import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with caplog.at_level("WARNING", logger="clora.simulate"):
        code = main(["simulate", "--config", simulate_config(tmp_path), "--url", url, "--rate", "10"])
    assert code == 1
    out, err = capsys.readouterr()
    assert err.strip().splitlines() == [f"clora simulate: cannot reach serving at {url}: [Errno 111] Connection "
                                        "refused (stopped: no request could connect)"]
    sent = re.search(r"digits-app: (\d+) requests, \1 failed, no answers", out)  # no NaN, no empty versions
    assert sent and int(sent[1]) < 20, out  # stopped after the first few, not 600 in its 60 s
    assert not [r for r in caplog.records if r.name == "clora.simulate"]  # that one line says it all


@pytest.mark.parametrize("url", ["notaurl", "localhost:8000", "ftp://127.0.0.1:8000", "http://", "http://x:port"])
def test_a_url_that_is_not_http_is_a_usage_error(tmp_path, capsys, url):
    """`--url notaurl` failed every request for --seconds with "Connection error.", then exited 1."""
    from clora.cli import main

    assert main(["simulate", "--config", simulate_config(tmp_path), "--url", url, "--seconds", "30"]) == 2
    assert capsys.readouterr().err.strip() == (f"clora simulate: --url {url!r} is not an http:// or https:// URL "
                                               "with a host (e.g. http://127.0.0.1:8000)")


def test_an_unknown_preference_is_named(tmp_path, capsys):
    from clora.cli import main

    assert main(["simulate", "--config", simulate_config(tmp_path), "--preferences", "digits,foo"]) == 2
    assert capsys.readouterr().err.strip() == ("clora simulate: unknown preference(s) foo in --preferences; choose "
                                               "from digits, upper, short, json")


def test_preferences_that_do_not_match_the_tenants_in_number_are_a_warning(tmp_path, capsys):
    """Extra preferences were dropped, and too few used again, without a word."""
    from clora.cli import main

    assert main(["simulate", "--config", simulate_config(tmp_path), "--preferences", "upper,short",
                 "--url", "notaurl"]) == 2  # stops at the URL, after the warning
    err = capsys.readouterr().err
    assert ("clora simulate: warning: 2 preference(s) for 1 tenant(s): the extra ones are not used "
            "(digits-app: upper)") in err


def test_a_tenant_without_answers_is_summarised_without_nan():
    from clora.simulate import summary_lines

    t = SimTenant("acme", "k" * 8, "digits")
    failed = [Record(i, "acme", "", "", 0.0, "", False, "boom") for i in range(8)]
    answered = [Record(0, "acme", "r0", "base", 0.5, "", True)]
    assert summary_lines(summarise(failed, [t])) == ["acme: 8 requests, 8 failed, no answers"]
    assert summary_lines(summarise([], [t])) == ["acme: 0 requests, 0 failed, no answers"]
    assert summary_lines(summarise(answered, [t])) == ["acme: 1 requests, 0 failed, reward 0.500 -> 0.500, versions base"]


def test_a_tenants_line_counts_the_requests_it_sent_that_have_not_finished():
    """After a Ctrl-C, a tenant whose 8 requests awaited answers said "0 requests, 0 failed" under a traffic line
    that said 8 were sent and unanswered."""
    from clora.simulate import summary_lines

    t = SimTenant("acme", "k" * 8, "digits")
    answered = [Record(0, "acme", "r0", "base", 0.5, "", True), Record(1, "acme", "", "", 0.0, "", False, "boom")]
    assert summary_lines(summarise([], [t], sent={"acme": 8})) == [
        "acme: 8 requests, 0 finished (0 failed), 8 unanswered, no answers"]
    assert summary_lines(summarise(answered, [t], sent={"acme": 5})) == [
        "acme: 5 requests, 2 finished (1 failed), 3 unanswered, reward 0.500 -> 0.500, versions base"]
    assert summary_lines(summarise(answered, [t], sent={"acme": 2})) == [
        "acme: 2 requests, 1 failed, reward 0.500 -> 0.500, versions base"]


def test_simulate_does_not_fail_for_a_tenant_that_got_no_request(tmp_path, monkeypatch, capsys):
    """A short run at a low rate reaches only some tenants (round robin): no request is no failure."""
    from clora import simulate as simulate_module
    from clora.cli import main

    config = tmp_path / "clora.toml"
    config.write_text(f'data_dir = "{tmp_path / "data"}"\n[[tenants]]\nname = "a"\napi_key = "sk-a-00000000"\n'
                      '[[tenants]]\nname = "b"\napi_key = "sk-b-00000000"\n')

    def one_request(self):
        self.records.append(simulate_module.Record(0.1, "a", "r1", "a@1", 1.0, "ok", True))

    monkeypatch.setattr(simulate_module.Simulator, "run", one_request)
    assert main(["simulate", "--config", str(config), "--seconds", "1", "--rate", "1"]) == 0
    assert "no request succeeded" not in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--rate", "0"], ["--rate", "-1"], ["--seconds", "0"], ["--seconds", "nan"],
                                  ["--rate", "inf"], ["--max-tokens", "0"]])
def test_simulate_refuses_a_rate_or_duration_that_is_not_above_0(tmp_path, capsys, args):
    from clora.cli import main

    with pytest.raises(SystemExit) as e:
        main(["simulate", "--config", simulate_config(tmp_path), *args])
    assert e.value.code == 2
    assert "must be" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------
# Traffic: a stand-in serving tier, a listener that never answers.


@contextmanager
def stand_in_serving(delay: float = 0.0, status: int = 200):
    """An HTTP server on loopback answering chat completions (after `delay` seconds) and feedback as serving
    does, or every request with an error `status`; yields its base URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if status != 200:
                status_, body = status, {"error": {"message": "no", "type": "invalid_request_error"}}
            elif self.path == "/v1/chat/completions":
                time.sleep(delay)
                status_, body = 200, {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m",
                                      "choices": [{"index": 0, "finish_reason": "stop",
                                                   "message": {"role": "assistant", "content": "42"}}]}
            else:  # /v1/feedback
                status_, body = 202, {"status": "accepted"}
            body = json.dumps(body).encode()
            self.send_response(status_)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("x-clora-adapter-version", "base")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def silent_listener():
    """A TCP listener on loopback that accepts connections and never answers; yields (URL, the connections
    accepted so far)."""
    srv = socket.create_server(("127.0.0.1", 0), backlog=64)
    srv.settimeout(0.1)
    accepted: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        while not done.is_set():
            try:
                accepted.append(srv.accept()[0])
            except TimeoutError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.getsockname()[1]}", accepted
    finally:
        done.set()
        thread.join()
        for conn in accepted:
            conn.close()
        srv.close()


def test_ctrl_c_stops_simulate_at_once_with_the_partial_figures(tmp_path):
    """Ctrl-C left the thread pool's `with` block, which waited for every queued request (each up to the
    client's 120 s timeout, none of them stopped): minutes of silence, then no figures."""
    with silent_listener() as (url, accepted):
        proc = subprocess.Popen([sys.executable, "-m", "clora", "simulate", "--config", simulate_config(tmp_path),
                                 "--url", url, "--seconds", "300", "--rate", "20"], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            while len(accepted) < 8 and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert len(accepted) == 8, f"simulate did not send 8 requests: {proc.poll()} {accepted}"
            time.sleep(0.5)  # ticks that find all 8 awaiting answers
            proc.send_signal(signal.SIGINT)
            try:
                out, err = proc.communicate(timeout=30)  # 2 s of grace for the 8 requests in flight
            except subprocess.TimeoutExpired:
                pytest.fail("simulate still ran 30 s after Ctrl-C")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 130, err[-2000:]
    assert "clora simulate: interrupted after" in err and "interrupted" not in out  # on stderr, as for `clora query`
    assert "8 requests sent, 0 finished (0 failed), 8 unanswered" in err
    assert "were awaiting answers, the most at once" in err  # the ticks not sent
    assert "digits-app: 8 requests, 0 finished (0 failed), 8 unanswered, no answers" in out  # not "0 requests"


def test_a_tick_that_finds_every_slot_awaiting_an_answer_sends_nothing():
    """Requests were queued at --rate without bound when the server was slow."""
    from clora.simulate import Simulator

    with stand_in_serving(delay=1.0) as url:
        sim = Simulator(url, [SimTenant("a", "k" * 8, "digits")], rate=20, duration=0.5, concurrency=2)
        records = sim.run()
    assert sim.sent == 2 and len(records) == 2 and all(r.ok for r in records)
    assert sim.not_sent > 0  # ~10 ticks in 0.5 s, each after the first two finding both slots taken
    assert f"; {sim.not_sent} not sent: 2 were awaiting answers" in sim.traffic_line()


def test_simulate_against_this_machine_ignores_the_environments_proxy(tmp_path, proxied, capsys):
    """With http_proxy set (a host whose proxy is for outside traffic), httpx and the openai client sent the
    requests for 127.0.0.1 to the proxy, which cannot reach this machine's loopback: every request failed."""
    from clora.cli import main

    with stand_in_serving() as url:
        code = main(["simulate", "--config", simulate_config(tmp_path), "--url", url, "--seconds", "0.5",
                     "--rate", "10"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert re.search(r"digits-app: [1-9][0-9]* requests, 0 failed", out), out


def test_a_low_rate_ends_at_the_runs_end_and_reports_progress_on_time():
    """The loop slept until the next tick: 5.7 s for --seconds 1 --rate 0.2, a traceback for --rate 1e-10
    (a wait past what a timeout can hold), and progress only at ticks."""
    from clora.simulate import Simulator

    with stand_in_serving(delay=0.0) as url:
        for rate in (0.2, 1e-10):
            reports = []
            sim = Simulator(url, [SimTenant("a", "k" * 8, "digits")], rate=rate, duration=1.0, progress_seconds=0.25)
            started = time.monotonic()
            records = sim.run(progress=lambda s: reports.append(time.monotonic() - started))
            assert time.monotonic() - started < 4.5  # it ran 5 s (the tick after the end) or raised
            assert sim.sent == 1 and len(records) == 1 and records[0].ok
            assert len(reports) >= 3, reports  # every 0.25 s of the second, not once per tick


def test_a_server_that_never_answers_cannot_hold_the_run_past_its_end():
    """Against a listener that accepts and never answers, `--seconds 2` took 2 minutes (each request waited 120 s,
    and the run for every one of them): a request now waits until the run's end plus answer_grace."""
    from clora.simulate import Simulator

    with silent_listener() as (url, accepted):
        sim = Simulator(url, [SimTenant("a", "k" * 8, "digits")], rate=10, duration=0.5, answer_grace=0.5)
        records = sim.run()
    assert len(accepted) > 0 and sim.sent == len(records) > 0
    # each waited at most until the run's end plus the grace (at least 1 s), not 120 s
    waits = [float(re.fullmatch(r"no answer within ([0-9.]+)s from .*", r.error)[1]) for r in records]
    assert not any(r.ok for r in records) and max(waits) <= 1.0, waits
    assert sim.unreachable is None  # slow is not unreachable: it connected


def test_serving_that_goes_away_mid_run_is_retried_for_a_while_then_the_run_stops(caplog):
    """Once serving has answered, failures to connect are an outage (`clora up` restarting it): one warning, retries
    for outage_seconds, then the run stops with the reason in `unreachable`."""
    from contextlib import ExitStack

    from clora.simulate import Simulator

    stack = ExitStack()
    url = stack.enter_context(stand_in_serving())

    def take_serving_away(sim):
        if any(r.ok for r in sim.records):
            stack.close()  # shuts the server and closes its socket: connections are refused from now on

    sim = Simulator(url, [SimTenant("a", "k" * 8, "digits")], rate=20, duration=30, progress_seconds=0.2,
                    outage_seconds=0.5)
    with stack, caplog.at_level("INFO", logger="clora.simulate"):
        sim.run(progress=take_serving_away)
    assert sim.sent < 200, sim.sent  # stopped within the outage's half second, not 600 in its 30 s
    assert any(r.ok for r in sim.records) and not sim.records[-1].ok
    assert sim.unreachable is not None and sim.unreachable.startswith(f"cannot reach serving at {url}: ")
    assert "after serving had answered" in sim.unreachable
    logged = [r.getMessage() for r in caplog.records if r.name == "clora.simulate"]
    assert len(logged) == 1 and "retrying for up to 0.5s" in logged[0], logged  # one line, not one per request


def test_a_connection_that_times_out_is_unreachable_not_slow(monkeypatch):
    """An address that drops packets never connects: it counted as a slow answer, so the run never stopped."""
    import httpx

    import clora.simulate as simulate

    def drop(request):
        raise httpx.ConnectTimeout("timed out", request=request)

    class DroppingClient(httpx.Client):
        def __init__(self, **kwargs):
            super().__init__(transport=httpx.MockTransport(drop), **kwargs)

    monkeypatch.setattr(httpx, "Client", DroppingClient)  # simulate imports httpx where it sends
    sim = simulate.Simulator("http://127.0.0.1:9", [SimTenant("a", "k" * 8, "digits")], rate=10, duration=30)
    records = sim.run()
    assert sim.unreachable == ("cannot reach serving at http://127.0.0.1:9: connecting timed out (stopped: no "
                               "request could connect)")
    assert 0 < len(records) < 20 and not any(r.ok for r in records)
