"""The serving process's HTTP edge: it binds its port before the engine's long start (a taken port fails at
once, clearly), bounds the connections uvicorn takes, and warns at start when tenants' names are open to the
network."""

from __future__ import annotations

import asyncio
import json
import contextlib
import logging
import os
import socket
import subprocess
import sys

import pytest

from serving_process import REPO, write_config

pytestmark = pytest.mark.unit


async def answer_ok(scope, receive, send):
    """An ASGI app answering every HTTP request 200 "ok"."""
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


@contextlib.asynccontextmanager
async def ok_server(*, connections: int, on_refused=None):
    """Serving's uvicorn server (`http_server`) answering every request 200 "ok" on a free port: (server, port)."""
    from serving.__main__ import http_server, listen

    sock = listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = http_server(answer_ok, "127.0.0.1", port, connections=connections, grace=1, on_refused=on_refused)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield server, port
    finally:
        server.should_exit = True
        await serving


def test_a_taken_port_fails_the_start_at_once_with_a_clear_message(tmp_path, tiny_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        config = write_config(tmp_path, bootstrap="127.0.0.1:9", model_path=tiny_model, port=port)
        result = subprocess.run([sys.executable, "-m", "serving", "--config", str(config)], cwd=REPO,
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "starting the engine" not in result.stderr + result.stdout  # it never got that far


def test_listen_binds_without_accepting_yet():
    from serving.__main__ import listen

    sock = listen("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        with pytest.raises(ConnectionRefusedError):  # bound, not listening: clients are refused, not queued
            socket.create_connection(("127.0.0.1", port), timeout=2)
    finally:
        sock.close()


def test_a_helper_task_that_failed_does_not_stop_the_shutdown(caplog):
    """The stop awaits the adapter watcher and the engine monitor before the event log drains: one that
    raised is logged and stands for `failed`, so what follows it still runs."""
    import asyncio

    from serving.__main__ import ended

    async def broken():
        raise RuntimeError("monitor broke")

    async def fine():
        return False

    async def both():
        return (await ended(asyncio.create_task(broken()), "the engine monitor", failed=True),
                await ended(asyncio.create_task(fine()), "the adapter watcher", failed=True))

    assert asyncio.run(both()) == (True, False)
    assert "the engine monitor failed; stopping anyway" in caplog.text and "monitor broke" in caplog.text


def test_a_port_other_hosts_reach_without_an_admin_key_is_warned_about_at_start(tmp_path, tiny_model):
    """/health and /metrics name every tenant; with no serving.admin_key they are open to whoever reaches the
    port. Said at start, once the port is bound (here the start then fails: the model is not there); a port
    that cannot be bound is said alone (it was warned of first as if open to anyone)."""
    from ingest.broker import free_port

    config = write_config(tmp_path, bootstrap="127.0.0.1:9", model_path=tmp_path / "no-model", port=free_port(),
                          host="0.0.0.0")
    env = {k: v for k, v in os.environ.items() if k != "CLORA_ADMIN_KEY"}
    result = subprocess.run([sys.executable, "-m", "serving", "--config", str(config)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "no-model" in result.stderr
    assert ("WARNING serving: serving listens on 0.0.0.0 with no serving.admin_key: /health and /metrics, which "
            "name every tenant, are open to anyone who reaches the port; set serving.admin_key") in result.stderr
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        port = taken.getsockname()[1]
        config = write_config(tmp_path, bootstrap="127.0.0.1:9", model_path=tiny_model, port=port, host="0.0.0.0")
        result = subprocess.run([sys.executable, "-m", "serving", "--config", str(config)], cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stderr == f"serving: cannot listen on 0.0.0.0:{port}: Address already in use\n"


@pytest.mark.parametrize(("host", "admin_key_set", "warned"), [
    ("0.0.0.0", False, True), ("::", False, True), ("10.1.2.3", False, True), ("serving.internal", False, True),
    ("127.0.0.1", False, False), ("127.0.0.2", False, False), ("::1", False, False), ("localhost", False, False),
    ("0.0.0.0", True, False),
])
def test_only_a_port_open_to_other_hosts_with_no_admin_key_is_warned_about(caplog, host, admin_key_set, warned):
    from serving.__main__ import warn_if_open

    warn_if_open(host, admin_key_set)
    assert ("set serving.admin_key" in caplog.text) == warned


def test_the_connection_limit_leaves_room_for_the_engine_and_every_tenant():
    from serving.__main__ import CONNECTIONS_MIN, connection_limit

    assert connection_limit(tenants=3, max_num_seqs=64) == CONNECTIONS_MIN
    assert connection_limit(tenants=1000, max_num_seqs=256) == 2 * 256 + 4 * 1000


def test_past_its_connection_limit_uvicorn_answers_503_and_idle_connections_count():
    """Without limit_concurrency, uvicorn took any number of connections, each holding memory. Past the limit
    every new request is a 503 (in OpenAI's error shape: uvicorn's own is plain text) that closes its connection;
    idle connections count towards it."""
    from serving.__main__ import KEEP_ALIVE_SECONDS, RefusalLog, set_connection_limit

    refused = []

    async def scenario():
        async with ok_server(connections=3, on_refused=lambda: refused.append(1)) as (server, port):

            async def get(path: str = "/") -> bytes:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(f"GET {path} HTTP/1.1\r\nHost: clora\r\nConnection: close\r\n\r\n".encode())
                answer = await asyncio.wait_for(reader.read(), 5)  # to the end: the server closes the connection
                writer.close()
                return answer

            within = await get()
            idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]  # connected, sending nothing
            await asyncio.sleep(0.1)
            past = await get()
            # A load balancer's health check and a Prometheus scrape are answered past it all the same.
            checks = [await get("/health"), await get("/metrics")]
            limit = server.config.limit_concurrency
            set_connection_limit(server, 4)  # a config re-read added a tenant: room from the next connection
            raised = await get()
            for _, writer in idle:
                writer.close()
            return limit, server.config, within, past, raised, checks

    limit, config, within, past, raised, checks = asyncio.run(scenario())
    assert all(check.startswith(b"HTTP/1.1 200 OK") for check in checks), checks
    assert limit == 3 and config.timeout_keep_alive == KEEP_ALIVE_SECONDS
    assert within.startswith(b"HTTP/1.1 200 OK")
    head, _, body = past.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 Service Unavailable") and b"connection: close" in head
    assert b"retry-after: 1" in head and b"x-request-id: " in head and b"content-type: application/json" in head
    error = json.loads(body)["error"]  # OpenAI's shape, as every other refusal: clients read why
    assert error["type"] == "server_error" and error["code"] == "server_busy" and "connection limit" in error["message"]
    assert raised.startswith(b"HTTP/1.1 200 OK"), "the raised limit holds for the next connection"
    assert refused == [1], "each refusal is counted (clora_serving_connections_refused_total)"
    assert [f.limit for f in logging.getLogger("uvicorn.error").filters if isinstance(f, RefusalLog)] == [4]


def test_the_event_log_connects_to_kafka_as_the_config_says(tmp_path):
    """TLS and SASL settings reach serving's producer as they reach ingest's clients."""
    from clora.config import Config
    from serving.__main__ import event_log
    from serving.metrics import ServingMetrics

    cfg = Config.model_validate({"data_dir": str(tmp_path), "kafka": {
        "bootstrap": "kafka-1:9093", "security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-256",
        "sasl_username": "clora", "sasl_password": "pw", "ssl_cafile": str(tmp_path / "ca.pem")}})
    factory = event_log(cfg, ServingMetrics()).producer_factory
    assert factory.keywords["client"] == cfg.kafka.client_options()
    assert factory.keywords["client"]["security_protocol"] == "SASL_SSL"


def test_refusals_past_the_connection_limit_are_one_log_line_a_minute():
    import logging

    from serving.__main__ import RefusalLog

    now = [0.0]
    refusals = RefusalLog(limit=1024, every=60.0, clock=lambda: now[0])

    def refused() -> logging.LogRecord | None:
        record = logging.LogRecord("uvicorn.error", logging.WARNING, __file__, 1, RefusalLog.MESSAGE, (), None)
        return record if refusals.filter(record) else None

    first = refused()
    assert first.getMessage().startswith("1 request(s) past the connection limit, more than 1024 connections")
    assert [refused() for _ in range(500)] == [None] * 500
    now[0] = 61.0
    assert refused().getMessage().startswith("501 request(s) past the connection limit")
    other = logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1, "something else", (), None)
    assert refusals.filter(other) and other.getMessage() == "something else"


async def flood(port: int, head: bytes) -> bytes:
    """What the server answers to `head` followed by 4 MiB of one header's value (until it closes)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    answer = b""
    for _ in range(64):
        try:
            writer.write(b"a" * 65536)
            await writer.drain()
        except ConnectionError:
            break
        with contextlib.suppress(asyncio.TimeoutError, ConnectionError):
            answer += await asyncio.wait_for(reader.read(65536), 0.01)
        if reader.at_eof():
            break
    with contextlib.suppress(ConnectionError, asyncio.TimeoutError):
        while not reader.at_eof():
            answer += await asyncio.wait_for(reader.read(65536), 5)
    writer.close()
    return answer


def test_request_headers_past_the_size_limit_get_a_431_and_the_connection_closes():
    """httptools gathers a header's value piece by piece on the event loop (work growing with the square of
    its size), before the connection limit or the key is looked at: one connection sending a header of
    100 MiB held every request and stream for seconds. Headers near the limit, a kept-alive connection's
    next request and a body far larger than the limit are served."""
    from serving.http_timeouts import MAX_HEADER_BYTES

    async def scenario():
        async with ok_server(connections=100) as (_, port):
            refused = await flood(port, b"GET / HTTP/1.1\r\nHost: clora\r\nX-A: ")
            near = b"GET / HTTP/1.1\r\nHost: clora\r\nX-A: " + b"a" * (MAX_HEADER_BYTES - 1024) + b"\r\n\r\n"
            body = b"b" * (4 * MAX_HEADER_BYTES)
            posted = (b"POST / HTTP/1.1\r\nHost: clora\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n"
                      + body)
            kept, kept_writer = await asyncio.open_connection("127.0.0.1", port)
            answers = []
            for request in (near, posted, posted, near):
                kept_writer.write(request)
                answers.append(await asyncio.wait_for(kept.readuntil(b"ok"), 5))
            # a chunked body's trailers are headers too, gathered the same way (here after the answer went out)
            trailed = await flood(port, b"POST / HTTP/1.1\r\nHost: clora\r\ntransfer-encoding: chunked\r\n\r\n"
                                        b"5\r\nhello\r\n0\r\nX-T: ")
            return refused, answers, trailed

    refused, answers, trailed = asyncio.run(scenario())
    assert refused.startswith(b"HTTP/1.1 431 "), refused[:200]
    head, body = refused.split(b"\r\n\r\n", 1)
    assert json.loads(body)["error"]["code"] == "headers_too_large" and b"x-request-id: " in head
    assert len(answers) == 4 and all(a.startswith(b"HTTP/1.1 200 OK") for a in answers)
    assert trailed.startswith(b"HTTP/1.1 200 OK") and b"HTTP/1.1 431 " in trailed, trailed[:300]


def test_a_connection_idle_after_an_answer_is_closed_on_time_though_its_client_sends_line_ends():
    """uvicorn stops the keep-alive timer on any read, and the parser skips line ends between requests
    without beginning one: one "\\r\\n" after an answer held the connection (a place under the limit) for good."""

    async def scenario():
        async with ok_server(connections=100) as (server, port):
            server.config.timeout_keep_alive = 0.5
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nHost: clora\r\n\r\n")
            await asyncio.wait_for(reader.readuntil(b"ok"), 5)
            writer.write(b"\r\n")
            try:
                return await asyncio.wait_for(reader.read(), 5) == b""
            except asyncio.TimeoutError:
                return False

    assert asyncio.run(scenario())


def test_a_connection_whose_request_headers_do_not_come_whole_in_time_is_closed(monkeypatch):
    """uvicorn held a connection that never sent a request, or sent its headers a byte at a time, for as long as
    the client liked (each one a place under the connection limit). A kept-alive connection idle between
    requests is the keep-alive timeout's, not this limit's."""
    from serving.http_timeouts import HeaderTimeoutProtocol

    monkeypatch.setattr(HeaderTimeoutProtocol, "header_timeout_s", 0.5)

    request = b"GET / HTTP/1.1\r\nHost: clora\r\n\r\n"

    async def closed_within(reader, seconds) -> bool:
        try:
            return await asyncio.wait_for(reader.read(), seconds) == b""
        except asyncio.TimeoutError:
            return False

    async def scenario():
        async with ok_server(connections=100) as (_, port):
            silent, _ = await asyncio.open_connection("127.0.0.1", port)
            slow, slow_writer = await asyncio.open_connection("127.0.0.1", port)
            slow_writer.write(b"GET / HTTP/1.1\r\nHost: cl")  # and nothing more
            kept, kept_writer = await asyncio.open_connection("127.0.0.1", port)
            answers = []
            for _ in range(2):  # idle longer than the limit between the two: still served
                kept_writer.write(request)
                answers.append(await asyncio.wait_for(kept.readuntil(b"ok"), 5))
                await asyncio.sleep(1.0)
            bytewise, bytewise_writer = await asyncio.open_connection("127.0.0.1", port)
            for i in range(len(request)):  # a request's headers sent a byte at a time, whole within the limit
                bytewise_writer.write(request[i:i + 1])
                await asyncio.sleep(0.25 / len(request))
            answers.append(await asyncio.wait_for(bytewise.readuntil(b"ok"), 5))
            return await closed_within(silent, 5), await closed_within(slow, 5), answers

    silent_closed, slow_closed, answers = asyncio.run(scenario())
    assert silent_closed and slow_closed
    assert len(answers) == 3 and all(a.startswith(b"HTTP/1.1 200 OK") for a in answers)


BIG = 16 << 20  # an answer far past the sockets' buffers (a few MiB at most here)


async def answer_big(scope, receive, send):
    """An ASGI app answering every HTTP request with BIG bytes, whole in one send (as a non-streamed answer)."""
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(BIG).encode())]})
        await send({"type": "http.response.body", "body": b"x" * BIG})


def test_an_answer_its_client_stops_reading_is_dropped_but_a_slow_reader_gets_it_whole(monkeypatch):
    """uvicorn's send writes a whole answer into the transport's buffer and returns: a client that stopped
    reading held the connection and the answer's bytes for as long as it stayed connected. With nothing taken
    in for the write timeout the connection is aborted; a client that takes some in each period is not."""
    from serving.__main__ import http_server, listen
    from serving.http_timeouts import HeaderTimeoutProtocol

    monkeypatch.setattr(HeaderTimeoutProtocol, "write_timeout_s", 1.0)

    async def scenario():
        sock = listen("127.0.0.1", 0)
        port = sock.getsockname()[1]
        server = http_server(answer_big, "127.0.0.1", port, connections=10, grace=1)
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            request = b"GET / HTTP/1.1\r\nHost: clora\r\n\r\n"
            stalled, stalled_writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 16)
            stalled_writer.write(request)
            slow, slow_writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
            slow_writer.write(request)
            got = 0
            while got < BIG:  # a reader with pauses, taking something in each period
                chunk = await asyncio.wait_for(slow.read(1 << 20), 5)
                assert chunk, f"the slow reader's connection closed after {got} bytes"
                got += len(chunk)
                await asyncio.sleep(0.05)
            await asyncio.sleep(2.5)  # the stalled client has read nothing for over two write timeouts
            dropped = 0
            try:
                while chunk := await asyncio.wait_for(stalled.read(1 << 20), 5):
                    dropped += len(chunk)
            except ConnectionResetError:
                pass
            return got, dropped
        finally:
            server.should_exit = True
            await serving

    got, dropped = asyncio.run(scenario())
    assert got >= BIG  # headers and the whole body
    assert dropped < BIG, "the stalled client's answer was kept whole for it"
