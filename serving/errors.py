"""The errors the serving tier answers with, each knowing its HTTP status and OpenAI error `type`/`code`.

OpenAI clients parse `{"error": {"message", "type", "param", "code"}}` and pick an exception class by
status (400 BadRequestError, 401, 404, 413, 422, 429 RateLimitError, 5xx), so every refusal is one of
these; serving/api.py turns any of them into a response without knowing the cases. `param` names the
request field at fault (null when none), as OpenAI's own errors do. Raised by auth.py (who may use what),
adapters.py (which versions exist), engine.py (what the engine refuses) and api.py and protocol.py
(malformed, oversized or too many requests).
"""

from __future__ import annotations


class ServingError(Exception):
    """A request the serving tier refuses; `headers` go on the response (e.g. Retry-After)."""

    status: int = 400
    type: str = "invalid_request_error"
    code: str | None = None
    default_headers: dict[str, str] = {}  # what every answer of this kind carries (how a client should retry)

    def __init__(self, message: str, *, param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = {**self.default_headers, **(headers or {})}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class BadRequest(ServingError):
    status = 400
    code = "invalid_request"


class UnsupportedParameter(BadRequest):
    """A field OpenAI defines that this server does not implement (audio, `echo`, the deprecated functions...)."""

    code = "unsupported_parameter"


class ContextLengthExceeded(BadRequest):
    """The prompt leaves no room for the completion (OpenAI's code, so clients can tell it apart)."""

    code = "context_length_exceeded"


class Unauthenticated(ServingError):
    """OpenAI's own 401: type invalid_request_error, code invalid_api_key."""

    status = 401
    code = "invalid_api_key"


class ModelNotFound(ServingError):
    status = 404
    code = "model_not_found"


class UnknownRoute(ServingError):
    """No such URL (404) or not with this method (405); OpenAI answers both in its error shape."""

    status = 404
    code = "unknown_url"


class MethodNotAllowed(ServingError):
    status = 405
    code = "method_not_allowed"


class RequestTooLarge(ServingError):
    status = 413
    code = "request_too_large"


class IdempotencyKeyReused(ServingError):
    """An Idempotency-Key sent again with another request than its first (serving/idempotency.py)."""

    status = 422
    code = "idempotency_key_reused"


class IdempotencyKeyInUse(ServingError):
    """A try of an Idempotency-Key whose first request is running while idempotency.MAX_WAITING tries wait
    already: 409, as the IETF's Idempotency-Key draft answers a key in use (OpenAI's SDK retries it, after
    Retry-After)."""

    status = 409
    code = "idempotency_key_in_use"
    default_headers = {"Retry-After": "1"}


class RequestTimeout(ServingError):
    """A body not whole within api.BODY_TIMEOUT_S. The connection is closed with the answer: the rest of the
    body may still be on its way, and a client trickling bodies over many connections held memory with each."""

    status = 408
    code = "request_timeout"
    default_headers = {"connection": "close"}


class RateLimited(ServingError):
    """Too much in flight for one tenant; OpenAI's 429 shape (`type` "requests", code "rate_limit_exceeded")."""

    status = 429
    type = "requests"
    code = "rate_limit_exceeded"


class GenerationFailed(ServingError):
    """The engine ended a request with finish reason "error" (a request-level failure worth retrying)."""

    status = 500
    type = "server_error"
    code = "generation_failed"


class Unavailable(ServingError):
    """Worth sending again shortly (OpenAI's SDK retries a 503 on its own, after Retry-After)."""

    status = 503
    type = "server_error"
    code = "engine_unavailable"
    default_headers = {"Retry-After": "1"}


class HeadersTooLarge(ServingError):
    """Request headers (or a chunked body's trailers) past the size limit: answered by the HTTP server itself,
    before the app (http_timeouts.py), and the connection closed."""

    status = 431
    code = "headers_too_large"
    default_headers = {"connection": "close"}


class ServerBusy(Unavailable):
    """More connections and requests at once than the connection limit: answered by the HTTP server itself,
    before the app (http_timeouts.py)."""

    code = "server_busy"
    default_headers = {"Retry-After": "1", "connection": "close"}


class EngineStopped(Unavailable):
    """The engine died: only a restart of the server helps, so OpenAI's SDK is told not to retry
    (`x-should-retry: false`, which it honours before its own rules)."""

    default_headers = {"x-should-retry": "false"}


class AdapterUnavailable(Unavailable):
    """A published version asked for by name (`<tenant>@<n>`) that could not be loaded now for a reason that
    says nothing about the adapter (an I/O error, its files deleted by a retire under way, the engine): worth
    sending again; a version that is refused is a 404."""

    code = "adapter_unavailable"


class ServerStopping(Unavailable):
    """A generation still running when a stopping server's grace period ended (`serving.shutdown_grace_seconds`):
    worth sending again, to the server that replaces this one (not at once: it is still stopping)."""

    code = "server_stopping"
    default_headers = {"Retry-After": "5"}


class EventLogFull(ServingError):
    """Feedback the event log could not take (it holds twice `queue_bytes` already): worth sending again."""

    status = 503
    type = "server_error"
    code = "event_log_full"


class ClientClosedRequest(ServingError):
    """The client left while its body was being read, or while its request waited for the first one with its
    Idempotency-Key: counted (499, nginx's status), never sent, not logged as a failure of the server's."""

    status = 499
    type = "invalid_request_error"
    code = "client_closed_request"


def internal_error_body(e: BaseException) -> dict:
    """OpenAI's error shape for a failure of the server's own (HTTP 500, or the last event of a stream)."""
    return {"error": {"message": f"internal error: {type(e).__name__}", "type": "server_error", "param": None,
                      "code": None}}
