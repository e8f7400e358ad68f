"""The gateway's errors and how each reaches a client: OpenAI-shaped HTTP bodies and gRPC codes.

Upstream gRPC codes map to HTTP through `pagoda.contract.error_table` (the project's one table); only the
errors the gateway itself raises (unknown model, auth, body size, not ready) are listed here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

from pagoda.contract.error_table import http_status_for_grpc
from pagoda.contract.errors import InvalidRequestError


class GatewayError(Exception):
    """An error with a client-facing message; subclasses fix the codes."""

    http_status = 500
    grpc_code = grpc.StatusCode.INTERNAL
    retry_after_s: float | None = None  # a 429 / 503's Retry-After; None: the configured default

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ModelNotFoundError(GatewayError):
    http_status, grpc_code = 404, grpc.StatusCode.NOT_FOUND


class UnauthorizedError(GatewayError):
    http_status, grpc_code = 401, grpc.StatusCode.UNAUTHENTICATED


class RequestTooLargeError(GatewayError):
    http_status, grpc_code = 413, grpc.StatusCode.RESOURCE_EXHAUSTED


class RateLimitedError(GatewayError):
    """A tenant is over its requests/min, tokens/min or concurrency limit (gateway/tenancy/rate_limit.py)."""

    http_status, grpc_code = 429, grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineNotReadyError(GatewayError):
    """The scheduler has not answered GetInfo yet (or the tokenizer is still loading)."""

    http_status, grpc_code = 503, grpc.StatusCode.UNAVAILABLE


class ClientDisconnectedError(GatewayError):
    """The client went away before the answer was ready (nginx's 499); the request was aborted."""

    http_status, grpc_code = 499, grpc.StatusCode.CANCELLED


class UpstreamError(GatewayError):
    """The scheduler answered a call with a non-OK status; keeps its code for both APIs."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.grpc_code = code
        self.http_status = http_status_for_grpc(code)


_TYPE_NAMES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError",
               409: "ConflictError", 413: "RequestTooLargeError", 429: "RateLimitError",
               499: "ClientClosedRequest", 501: "NotImplementedError",
               503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}


@dataclass(frozen=True, slots=True)
class ClientError:
    """What a client is told: status codes for both APIs plus the message."""

    http_status: int
    grpc_code: grpc.StatusCode
    message: str
    param: str | None = None
    retry_after_s: float | None = None


def to_client_error(error: BaseException) -> ClientError:
    """The one place a gateway exception becomes a status; unknown errors stay generic (500)."""
    if isinstance(error, GatewayError):
        return ClientError(error.http_status, error.grpc_code, error.message, error.param,
                           error.retry_after_s)
    if isinstance(error, InvalidRequestError):
        return ClientError(400, grpc.StatusCode.INVALID_ARGUMENT, str(error))
    return ClientError(500, grpc.StatusCode.INTERNAL, "internal server error")


def openai_error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    error_type = _TYPE_NAMES.get(status, "InternalServerError")
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


# Anthropic's error types by HTTP status (its Messages API: POST /v1/messages).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}
ANTHROPIC_PATH = "/v1/messages"


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape: {"type": "error", "error": {"type", "message"}}."""
    error_type = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")
    return {"type": "error", "error": {"type": error_type, "message": message}}


def error_body(path: str, status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """The error body in the shape of the API `path` belongs to: Anthropic's under /v1/messages,
    OpenAI's everywhere else."""
    if path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/"):
        return anthropic_error_body(status, message)
    return openai_error_body(status, message, param)
