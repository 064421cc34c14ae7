"""learner.rollouts.ServingSampler against a stand-in HTTP server (no engine): it waits out 429s, 503s and
network errors, within one deadline."""

from __future__ import annotations

import collections
import concurrent.futures
import json
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from learner.rollouts import SampleRequest, SamplingError, ServingSampler

pytestmark = pytest.mark.unit


DROP = "drop"  # the stand-in's answer that is none: it closes the connection


@pytest.fixture
def stand_in_server():
    """A stand-in for serving's /v1/completions (named apart from conftest's `server`, the real one)."""
    class Answers(list):  # status codes to give, in order (DROP: no answer, the connection closed); then 200
        bodies: list  # the request bodies received

    answers = Answers()
    answers.bodies = bodies = []
    answers.keys = keys = []  # each request's Idempotency-Key header
    answers.token_ids = False  # whether the stand-in returns token ids and log-probs, as clora's serving does
    # API key -> an Event: that key's requests are refused (`refusal`, 429 unless changed) until it is set,
    # whatever `answers` holds
    answers.refused_until = refused_until = {}
    answers.refusal = 429
    answers.refusals = refusals = collections.Counter()  # refusals given (429, 503, DROP), by API key
    answers.raw = None  # with bytes here, a 200's body is those bytes

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            bodies.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
            keys.append(self.headers.get("idempotency-key"))
            key = self.headers["authorization"].removeprefix("Bearer ")
            if key in refused_until:
                status = 200 if refused_until[key].is_set() else answers.refusal
            else:
                status = answers.pop(0) if answers else 200
            if status in (429, 503, DROP):
                refusals[key] += 1
            if status == DROP:  # the connection closes with no answer: the client's network error
                self.close_connection = True
                return
            choice = {"index": 0, "text": " 42", "finish_reason": "stop"}
            if bodies[-1].get("return_token_ids") and answers.token_ids:
                choice.update(token_ids=[7, 8, 2], logprobs={"token_logprobs": [-0.5, None, -1.25]})
            code = {429: "rate_limit_exceeded", 503: "adapter_unavailable"}.get(status, "internal_error")
            body = ({"id": "cmpl-1", "choices": [choice]} if status == 200
                    else {"error": {"message": "not now", "type": "requests", "param": None, "code": code}})
            data = answers.raw if status == 200 and answers.raw is not None else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            if status in (429, 503):  # serving's adapter_unavailable says 1 s; a stand-in need not wait that long
                self.send_header("retry-after", "0.1")
            if status == 200:
                self.send_header("x-clora-adapter-version", "acme@3")
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *_):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", answers
    httpd.shutdown()
    httpd.server_close()


def request():
    return SampleRequest(tenant="acme", api_key="sk-acme-123", prompt="2+2=", n=1, max_tokens=4, temperature=1.0)


def test_a_rate_limited_rollout_waits_for_room(stand_in_server):
    url, answers = stand_in_server
    answers.extend([429, 429])
    (samples,) = ServingSampler(url).sample([request()])
    assert [s.text for s in samples] == [" 42"] and not answers


def test_a_rollout_refused_429_past_the_wait_fails_its_step(stand_in_server, monkeypatch):
    from learner import rollouts

    url, answers = stand_in_server
    answers.refused_until["sk-acme-123"] = threading.Event()  # never set: always 429
    monkeypatch.setattr(rollouts, "RETRY_WAIT_S", 0.5)
    with pytest.raises(SamplingError, match="answered 429"):
        ServingSampler(url).sample([request()])
    assert answers.refusals["sk-acme-123"] >= 2  # it waited (Retry-After 0.1 s) and asked again before giving up


def test_rollouts_to_a_local_serving_bypass_the_environments_proxy(stand_in_server, proxied):
    url, _ = stand_in_server
    (samples,) = ServingSampler(url).sample([request()])
    assert [s.text for s in samples] == [" 42"]


def test_the_prompt_goes_as_the_token_ids_the_learner_trains_on(stand_in_server):
    """As ids, the engine samples from exactly the trained prompt, whatever serving would add to a text
    prompt (a BOS, as vLLM's completions endpoint adds one for Llama-family tokenizers)."""
    from dataclasses import replace

    url, answers = stand_in_server
    ServingSampler(url).sample([replace(request(), prompt_ids=(17, 4, 99)), request()])
    assert sorted(str(b["prompt"]) for b in answers.bodies) == ["2+2=", "[17, 4, 99]"]


def test_rollouts_queue_behind_production_requests_at_the_priority_the_config_gives(stand_in_server):
    url, answers = stand_in_server
    sampler = ServingSampler(url)
    sampler.sample([request()])
    sampler.priority = 0  # learner.rollout_priority changed in the config: from the next request
    sampler.sample([request()])
    assert [b["priority"] for b in answers.bodies] == [1, 0]


def test_samples_carry_the_sampled_token_ids_and_log_probs_when_the_server_returns_them(stand_in_server):
    url, answers = stand_in_server
    (old,) = ServingSampler(url).sample([request()])
    assert old[0].token_ids is None and old[0].logprobs is None  # a server without them: the text only
    answers.token_ids = True
    (samples,) = ServingSampler(url).sample([request()])
    assert answers.bodies[-1]["return_token_ids"] is True and answers.bodies[-1]["logprobs"] == 0
    assert samples[0].token_ids == (7, 8, 2)
    assert samples[0].logprobs[0] == -0.5 and samples[0].logprobs[2] == -1.25
    assert samples[0].logprobs[1] != samples[0].logprobs[1]  # a missing one is NaN (the current policy's is used)


@pytest.mark.parametrize("refusals", [[503], [DROP], [503, DROP, 429, 503]], ids=["503", "network", "mixed"])
def test_a_rollout_refused_503_or_cut_off_by_the_network_asks_again(stand_in_server, refusals):
    """A 503 (`adapter_unavailable` while a version cannot be loaded, `server_stopping` during a restart) or
    a dropped connection passes: failing the step would throw away its other requests' completions and
    back the tenant off for 5 s to 5 minutes."""
    url, answers = stand_in_server
    answers.extend(refusals)
    (samples,) = ServingSampler(url).sample([request()])
    assert [s.text for s in samples] == [" 42"] and not answers
    assert len(answers.bodies) == len(refusals) + 1  # the same request, asked again after each
    # every try under one Idempotency-Key: serving answers a try whose first got through from that one
    assert len(set(answers.keys)) == 1 and answers.keys[0].startswith("rollout-")
    ServingSampler(url).sample([request(), request()])
    assert len(set(answers.keys)) == 3, "each request has its own key"


@pytest.mark.parametrize("refusal, named", [(503, "answered 503"), (DROP, "RemoteProtocolError")])
def test_a_503_or_network_error_past_the_wait_fails_its_step_naming_it(stand_in_server, monkeypatch, refusal, named):
    from learner import rollouts

    url, answers = stand_in_server
    answers.refused_until["sk-acme-123"] = threading.Event()  # never set: always refused
    answers.refusal = refusal
    monkeypatch.setattr(rollouts, "RETRY_WAIT_S", 0.5)
    monkeypatch.setattr(rollouts, "NETWORK_RETRY_S", 0.1)
    with pytest.raises(SamplingError, match=named) as failed:
        ServingSampler(url).sample([request()])
    assert "0.5 s" in str(failed.value)  # says it was not a first refusal
    assert answers.refusals["sk-acme-123"] >= 2  # it waited and asked again before giving up


@pytest.mark.parametrize("status", [500, 400])
def test_other_errors_fail_the_request_at_once(stand_in_server, status):
    url, answers = stand_in_server
    answers.append(status)
    with pytest.raises(SamplingError, match=f"answered {status}: "):
        ServingSampler(url).sample([request()])
    assert len(answers.bodies) == 1


def test_a_401_is_asked_again_while_serving_may_not_have_read_a_new_key_yet(stand_in_server, monkeypatch):
    """A tenant's api_key changed in the config reaches the learner and serving each at its own re-read: a
    step's rollouts answered 401 in between failed it, its samples drawn so far thrown away."""
    from learner import rollouts

    url, answers = stand_in_server
    monkeypatch.setattr(rollouts, "AUTH_RETRY_S", 1.5)
    answers.append(401)
    (samples,) = ServingSampler(url).sample([request()])
    assert [s.text for s in samples] == [" 42"] and len(answers.bodies) == 2
    answers.extend([401] * 5)  # a key serving never takes: refused once AUTH_RETRY_S is over
    with pytest.raises(SamplingError, match="answered 401: "):
        ServingSampler(url).sample([request()])


@pytest.mark.parametrize("raw", [b"<html>a proxy's page</html>", b'{"choices": null}', b"[1, 2]"])
def test_a_200_whose_body_is_not_a_completions_answer_fails_the_request_naming_serving(stand_in_server, raw):
    """It raised the JSON parser's or a TypeError from deep in the parsing: the step's error said nothing of
    serving."""
    url, answers = stand_in_server
    answers.raw = raw
    with pytest.raises(SamplingError, match="answered 200 with a body that is not a completions answer") as failed:
        ServingSampler(url).sample([request()])
    assert url in str(failed.value) and raw.decode()[:10] in str(failed.value)


def test_a_prompts_file_that_is_not_utf8_is_a_sampling_error_naming_it(tmp_path):
    from learner.rollouts import read_prompts_file

    path = tmp_path / "prompts.txt"
    path.write_bytes(b"\xff\xfeW\x00r\x00")  # UTF-16, as some editors save
    with pytest.raises(SamplingError, match=f"cannot read prompts_file {path}: 'utf-8' codec can't decode"):
        read_prompts_file(path)


def test_a_tenant_waiting_out_429s_does_not_hold_back_another_tenants_rollouts(stand_in_server):
    """acme's requests are refused until released, and its four take both of the sampler's threads (concurrency
    2); globex's request is answered while acme's are still being refused."""
    url, answers = stand_in_server
    acme_released = answers.refused_until["sk-acme-123"] = threading.Event()
    sampler = ServingSampler(url, concurrency=2)
    other = SampleRequest(tenant="globex", api_key="sk-globex-123", prompt="1+1=", n=1, max_tokens=4, temperature=1.0)
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as jobs:
            acme = jobs.submit(sampler.sample, [request()] * 4)
            while answers.refusals["sk-acme-123"] < 4:  # both threads busy with acme's requests, asleep between 429s
                assert not acme.done(), acme.exception()
                time.sleep(0.01)
            globex = jobs.submit(sampler.sample, [other])
            try:
                (samples,) = globex.result(timeout=60)  # behind acme's requests, it would wait for their release
            finally:
                refused_before_release = not acme.done()
                acme_released.set()
            assert [s.text for s in samples] == [" 42"]
            assert refused_before_release and answers.refusals["sk-acme-123"] >= 4
            assert [[s.text for s in one] for one in acme.result(timeout=30)] == [[" 42"]] * 4
    finally:
        sampler.close()


# A process that samples through a server that accepts the connection and never answers, then closes its
# Prefetcher and sampler (what Learner.close does after SIGTERM) and says how long its exit took after that.
NEVER_ANSWERED = textwrap.dedent(r"""
    import atexit, socket, threading, time
    from learner.rollouts import Prefetcher, RolloutPlan, SampleRequest, ServingSampler

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    received, held = threading.Event(), []

    def receive():
        connection, _ = server.accept()
        held.append(connection)
        while b"\r\n\r\n" not in b"".join(held[1:]):  # the request's headers: the client reads its answer next
            held.append(connection.recv(65536))
        received.set()

    threading.Thread(target=receive, daemon=True).start()
    sampler = ServingSampler(f"http://127.0.0.1:{server.getsockname()[1]}", timeout=3600.0)
    prefetcher = Prefetcher(sampler)
    prefetcher.start("acme", RolloutPlan(("hi",), ()), [SampleRequest("acme", "k", "hi", 2, 4, 1.0)], step=1)
    assert received.wait(30)
    time.sleep(0.5)  # the body too, and the client blocked in its read
    prefetcher.close()
    sampler.close()
    closed = time.monotonic()
    atexit.register(lambda: print(f"exited in {time.monotonic() - closed:.2f}", flush=True))
""")


def test_a_process_stopping_does_not_wait_for_a_rollout_request_blocked_in_its_read():
    """The interpreter joins a thread pool's threads at exit: a rollout request blocked in its read held the
    stopping learner up to the HTTP timeout (300 s by default; an hour here, so that a process waiting for it
    outlives the run's own limit and fails the test, however slow the machine)."""
    out = subprocess.run([sys.executable, "-c", NEVER_ANSWERED], cwd=Path(__file__).resolve().parents[2],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("exited in "), out.stdout  # it got as far as closing, and exited


@pytest.mark.parametrize("header, wait", [
    ("3600", 10.0), ("0", 0.05), ("-5", 0.05), ("2.5", 2.5), (None, 1.0),
    ("Wed, 21 Oct 2026 07:28:00 GMT", 1.0),  # an HTTP date: not read, the default wait
])
def test_a_retry_waits_what_retry_after_says_within_bounds(header, wait):
    """At most 10 s (a server's hour-long Retry-After must not stall a step), at least 0.05 s, 1 s without one."""
    from types import SimpleNamespace

    from learner.rollouts import _retry_after

    assert _retry_after(SimpleNamespace(headers={} if header is None else {"retry-after": header})) == wait
