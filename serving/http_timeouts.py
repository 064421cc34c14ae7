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
stream for seconds (the work grows with the square of the size). A request whose headers are still not
whole past MAX_HEADER_BYTES is answered 431 in OpenAI's error shape and its connection closed. The bytes
are counted as they come, while a request's headers are incomplete; a chunk read in which another request
ended and this one began is not counted (it holds that request's body too), so at most one read (256 KiB)
more than the limit is ever parsed.

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

from serving.errors import ServerBusy

# The method extended below is uvicorn's own (0.45 and later): renamed, serving would answer past the
# connection limit in plain text and refuse /health, silently. Checked at import, so a start fails instead.
if not hasattr(HttpToolsProtocol, "_start_asgi_task"):
    raise ImportError("this uvicorn's HttpToolsProtocol has no _start_asgi_task (uvicorn >= 0.45 has): install a "
                      "uvicorn this clora supports")

logger = logging.getLogger(__name__)

HEADER_TIMEOUT_S = 30.0  # a request's headers must be whole within this
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


def headers_too_large() -> bytes:
    """The raw 431 answer to a request whose headers are past MAX_HEADER_BYTES (its connection then closes)."""
    body = json.dumps({"error": {
        "message": f"the request's headers are larger than this server takes ({MAX_HEADER_BYTES} bytes)",
        "type": "invalid_request_error", "param": None, "code": "headers_too_large"}}).encode()
    return (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)


class HeaderTimeoutProtocol(HttpToolsProtocol):
    header_timeout_s = HEADER_TIMEOUT_S
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
        self._start_headers_timer()

    def data_received(self, data: bytes) -> None:
        waiting = self._headers_timer  # set: a request's headers were awaited before this read
        super().data_received(data)
        if self._headers_timer is None or self.transport.is_closing():
            return  # the headers are whole (or the parser closed the connection)
        if self._headers_timer is waiting:  # every byte of this read is the incomplete headers'
            self._header_bytes += len(data)
            if self._header_bytes > self.max_header_bytes:
                self._stop_headers_timer()
                logger.debug("closing a connection from %s: its request headers are past %d bytes", self.client,
                             self.max_header_bytes)
                self.transport.write(headers_too_large())
                self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._headers_timer is None:  # a later request on this connection: its headers from its first byte
            self._start_headers_timer()

    def on_headers_complete(self) -> None:
        self._stop_headers_timer()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_headers_timer()
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
