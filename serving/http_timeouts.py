"""uvicorn's HTTP protocol (httptools), with a time limit on a request's headers, and its refusal past the
connection limit in OpenAI's error shape.

uvicorn closes a connection idle after an answer (keep-alive), and serving's handler gives a body 30 s
(api.BODY_TIMEOUT_S); nothing limited the time before the handler runs. A client that connects and sends
nothing, or sends its headers a byte at a time, held its connection (and a place under the connection
limit) for as long as it liked: enough of them fill the limit, and every other client gets 503s.

`HeaderTimeoutProtocol` closes a connection whose request headers are not whole within HEADER_TIMEOUT_S of
the connection opening (the first request) or of the request's first byte (a later request on a kept-alive
connection; the wait before that byte is the keep-alive timeout's). Nothing is answered: the client never
finished asking.

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


class HeaderTimeoutProtocol(HttpToolsProtocol):
    header_timeout_s = HEADER_TIMEOUT_S
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
