"""uvicorn's HTTP protocol (httptools), with a time and a size limit on a request's headers, and its refusal
past the connection limit in OpenAI's error shape.

uvicorn closes a connection idle after an answer (keep-alive), and serving's handler gives a body 30 s
(api.BODY_TIMEOUT_S); nothing limited the time before the handler runs. A client that connects and sends
nothing, or sends its headers a byte at a time, held its connection (and a place under the connection
limit) for as long as it liked: enough of them fill the limit, and every other client gets 503s.

`HeaderTimeoutProtocol` closes a connection whose request headers are not whole within HEADER_TIMEOUT_S of
the connection opening (the first request) or of the request's first byte (a later request on a kept-alive
connection; the wait before that byte is the keep-alive timeout's). Nothing is answered: the client never
finished asking.

Nor did anything limit the headers' size: httptools gathers a header's value (and uvicorn the URL) by
appending each piece read to what it has, on the event loop, before any check of the connection limit or
the key, so one connection sending a header of 100 MiB within the time limit held every other request and
stream for seconds (the work grows with the square of the size). Headers still incomplete past
MAX_HEADER_BYTES are answered 431 in OpenAI's error shape and the connection closed (the answer is left
out when another request's answer is still going out on that connection: it would land inside it). The
bytes are counted read by read while a request's headers are incomplete, but not in the read where they
began (it may hold the previous request's body too), so at most two reads (uvloop reads 256 KiB) past the
limit are ever parsed; headers that are whole within the read they began in are not counted at all. A
chunked body's trailers are headers too: from its last chunk's size line they are held to the same time
and size limits.

A client that stops reading an answer (connected, its TCP window full) held the connection and the answer's
bytes in the transport's buffer for as long as it stayed connected (uvicorn's send writes a whole answer into
the buffer and returns; tens of MiB with log-probs). While the buffer is over its high-water mark, it is
looked at every WRITE_TIMEOUT_S: when none of it went out since the last look, the connection is aborted
(the buffer dropped; the request's handler sees the client gone). A slow reader that takes something in each
period is left alone.

A connection idle between requests whose client sends bare line ends: uvicorn stops its keep-alive timer on
any read, and the parser skips line ends between requests without starting one, so it was held for good;
the timer is started again after a read that began no request.

Past the connection limit uvicorn answers 503 with a plain-text body ("Service Unavailable"), no Retry-After
and no request id; `busy` answers it as every other refusal of serving is answered (errors.ServerBusy:
OpenAI's error body, Retry-After, x-request-id), so clients and scripts reading `error.message` see why.
`/health` and `/metrics` are answered past the limit all the same (ALWAYS_ANSWERED): an overload is when a
load balancer's health check and a Prometheus scrape matter most, and both are cheap.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid

from uvicorn.protocols.http.flow_control import service_unavailable
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from serving.errors import HeadersTooLarge, ServerBusy

# The method extended below is uvicorn's own (0.45 and later): renamed, serving would answer past the
# connection limit in plain text and refuse /health, silently. Checked at import, so a start fails instead.
if not hasattr(HttpToolsProtocol, "_start_asgi_task"):
    raise ImportError("this uvicorn's HttpToolsProtocol has no _start_asgi_task (uvicorn >= 0.45 has): install a "
                      "uvicorn this clora supports")

logger = logging.getLogger(__name__)

HEADER_TIMEOUT_S = 30.0  # a request's headers must be whole within this
WRITE_TIMEOUT_S = 60.0  # an answer's buffered bytes not one of which the client took in this long: it has left
MAX_HEADER_BYTES = 64 * 1024  # and hold at most this (the request line too); an SDK's are under 2 KiB
ALWAYS_ANSWERED = frozenset({"/health", "/metrics"})


async def busy(scope, receive, send) -> None:
    """The ASGI answer to a request past the connection limit (in place of uvicorn's `service_unavailable`)."""
    error = ServerBusy("the server is at its connection limit (connections and requests at once); "
                       "send the request again shortly")
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"x-request-id", uuid.uuid4().hex.encode()),
               *((k.lower().encode(), v.encode()) for k, v in error.headers.items())]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def headers_too_large(limit: int) -> bytes:
    """The raw 431 answer to a request whose headers are past `limit` bytes (its connection then closes)."""
    error = HeadersTooLarge(f"the request's headers are larger than this server takes ({limit} bytes)")
    body = json.dumps(error.body()).encode()
    head = [b"HTTP/1.1 431 Request Header Fields Too Large", b"content-type: application/json",
            b"content-length: " + str(len(body)).encode(), b"x-request-id: " + uuid.uuid4().hex.encode(),
            *(f"{k.lower()}: {v}".encode() for k, v in error.headers.items())]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


class HeaderTimeoutProtocol(HttpToolsProtocol):
    header_timeout_s = HEADER_TIMEOUT_S
    write_timeout_s = WRITE_TIMEOUT_S
    max_header_bytes = MAX_HEADER_BYTES
    on_refused = None  # called for each request answered `busy` (a subclass's: serving's counter)

    def _start_asgi_task(self, cycle, app) -> None:  # type: ignore[override]
        if app is service_unavailable:
            if cycle.scope.get("path") in ALWAYS_ANSWERED:
                app = self.app
            else:
                app = busy
                if self.on_refused is not None:
                    self.on_refused()
        super()._start_asgi_task(cycle, app)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._headers_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._start_headers_timer()

    def pause_writing(self) -> None:
        """The transport's buffer went over its high-water mark: watched until it drains (`_write_watch`)."""
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.write_timeout_s, self._write_watch,
                                                     self.transport.get_write_buffer_size())

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stop_write_timer()

    def _write_watch(self, before: int) -> None:
        self._write_timer = None
        if self.transport.is_closing():
            return
        now = self.transport.get_write_buffer_size()
        if now < before:  # the client took some in: watched on
            self._write_timer = self.loop.call_later(self.write_timeout_s, self._write_watch, now)
            return
        logger.info("aborting a connection from %s: its client took none of %d bytes of its answer in %gs",
                    self.client, now, self.write_timeout_s)
        self.transport.abort()

    def _stop_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def data_received(self, data: bytes) -> None:
        waiting = self._headers_timer  # set: a request's headers (or trailers) were awaited before this read
        idle = self.timeout_keep_alive_task is not None  # between requests, on the keep-alive timer
        self._began = False
        super().data_received(data)  # stops the keep-alive timer
        if self.transport.is_closing():
            return
        if idle and not self._began and self._headers_timer is None:  # bare line ends: still idle
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)
        if self._headers_timer is None or self._headers_timer is not waiting:
            return  # whole, or begun in this read (which may hold the previous request's body): not counted
        self._header_bytes += len(data)  # every byte of this read is the incomplete headers'
        if self._header_bytes > self.max_header_bytes:
            self._stop_headers_timer()
            logger.debug("closing a connection from %s: its request headers are past %d bytes", self.client,
                         self.max_header_bytes)
            if self.cycle is None or self.cycle.response_complete:  # not inside another request's answer
                self.transport.write(headers_too_large(self.max_header_bytes))
            self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._began = True
        if self._headers_timer is None:  # a later request on this connection: its headers from its first byte
            self._start_headers_timer()

    def on_chunk_header(self) -> None:
        """A chunk's size line (httptools calls it when the protocol has it): after the last one (size 0) come
        the trailers, which the parser gathers as it gathers headers."""
        if self._headers_timer is None:
            self._start_headers_timer()

    def on_body(self, body: bytes) -> None:
        self._stop_headers_timer()  # a chunk's data: no trailers
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._stop_headers_timer()
        super().on_message_complete()

    def on_headers_complete(self) -> None:
        self._stop_headers_timer()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_headers_timer()
        self._stop_write_timer()
        super().connection_lost(exc)

    def _start_headers_timer(self) -> None:
        self._headers_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)
        self._header_bytes = 0

    def _stop_headers_timer(self) -> None:
        if self._headers_timer is not None:
            self._headers_timer.cancel()
            self._headers_timer = None

    def _headers_late(self) -> None:
        self._headers_timer = None
        if not self.transport.is_closing():
            logger.debug("closing a connection from %s: no whole request headers within %gs", self.client,
                         self.header_timeout_s)
            self.transport.close()
