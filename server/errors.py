"""The one error taxonomy: every failure a client can see, and its OpenAI shape.

Errors are raised, never returned. `APIError.to_body()` is the single mapping
to OpenAI's `{"error": {...}}` JSON; the HTTP layer uses `status` for plain
responses and `sse_event()` once headers are sent and a stream is under way.
"""

import json
from typing import Any

from starlette.responses import JSONResponse


class APIError(Exception):
    """Base of every client-visible error."""

    status: int = 500
    type: str = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def to_body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def to_response(self) -> JSONResponse:
        return JSONResponse(self.to_body(), status_code=self.status)

    def sse_event(self) -> str:
        return f"data: {json.dumps(self.to_body())}\n\n"


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
