"""The errors the serving tier answers with, each knowing its HTTP status and OpenAI error `type`/`code`.

OpenAI clients parse `{"error": {"message", "type", "code"}}` and pick an exception class by status, so
every refusal is one of these; serving/api.py turns any of them into a response without knowing the cases.
Raised by auth.py (who may use what), adapters.py (which versions exist), engine.py (what the engine
refuses) and api.py (malformed requests).
"""

from __future__ import annotations


class ServingError(Exception):
    """A request the serving tier refuses."""

    status: int = 400
    type: str = "invalid_request_error"
    code: str | None = None

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code}}


class BadRequest(ServingError):
    status = 400
    code = "invalid_request"


class Unauthenticated(ServingError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(ServingError):
    status = 403
    type = "permission_error"
    code = "model_not_permitted"


class ModelNotFound(ServingError):
    status = 404
    code = "model_not_found"


class Unavailable(ServingError):
    status = 503
    type = "server_error"
    code = "engine_unavailable"


def internal_error_body(e: BaseException) -> dict:
    """OpenAI's error shape for a failure of the server's own (HTTP 500, or the last event of a stream)."""
    return {"error": {"message": f"internal error: {type(e).__name__}", "type": "server_error", "code": None}}
