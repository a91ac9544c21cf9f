"""The one error taxonomy: every failure a client can see, and its OpenAI shape.

Errors are raised, never returned, and know nothing of the transport. `APIError.to_body()`
is the single mapping to OpenAI's `{"error": {...}}` JSON; each kind names the HTTP status
and the headers (Retry-After, rate limits) the edge sends it with: api/replies.py makes the
response, serving/sse.py the event of a stream under way (on the Responses API: an `error`
event of `stream_event_fields()`).
"""

from typing import Any


class APIError(Exception):
    """Base of every client-visible error."""

    status: int = 500
    type: str = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = headers or {}

    def to_body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def stream_event_fields(self) -> dict[str, Any]:
        """The fields of the Responses API's `error` stream event: flat, and the
        code falls back to the type so the event always says which kind it is."""
        return {"code": self.code or self.type, "message": self.message, "param": self.param}


def error_statuses() -> list[int]:
    """Every HTTP status an `APIError` can carry, ascending."""
    statuses = set()
    pending: list[type[APIError]] = [APIError]
    while pending:
        cls = pending.pop()
        statuses.add(cls.status)
        pending.extend(cls.__subclasses__())
    return sorted(statuses)


class InvalidRequestError(APIError):
    status = 400
    type = "invalid_request_error"


class AuthenticationError(APIError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class PayloadTooLargeError(APIError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class BodyReadTimeoutError(APIError):
    """The client did not finish sending its body in time."""

    status = 408
    type = "invalid_request_error"
    code = "request_body_timeout"


class ContextLengthExceededError(InvalidRequestError):
    code = "context_length_exceeded"


class ModelNotFoundError(APIError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class NotFoundError(APIError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class EngineUnavailableError(APIError):
    status = 503
    type = "server_error"
    code = "engine_unavailable"


class InternalError(APIError):
    status = 500
    type = "server_error"
    code = "internal_error"


class RateLimitError(APIError):
    """A tenant's requests or tokens per minute are used up (OpenAI's shape:
    type "requests" or "tokens", code rate_limit_exceeded)."""

    status = 429
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, kind: str, headers: dict[str, str]) -> None:
        super().__init__(message, headers=headers)
        self.type = kind


class OverloadedError(APIError):
    """Every engine slot is busy and the wait queue is full or too slow."""

    status = 503
    type = "server_error"
    code = "server_overloaded"


class ShuttingDownError(APIError):
    status = 503
    type = "server_error"
    code = "server_shutting_down"


class RequestTimeoutError(APIError):
    """The request outlived its deadline; its generation was aborted."""

    status = 504
    type = "server_error"
    code = "request_timeout"
