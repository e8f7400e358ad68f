"""The one table that maps the domain exceptions (errors.py) to gRPC status codes and HTTP statuses.

Services raise domain exceptions; servicers (and the gateway) translate them here and nowhere
else. Anything not in the table is INTERNAL / 500 with a generic message (the traceback is logged).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from pagoda.contract.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    NotInitializedError,
    PlanError,
    QueueFullError,
    RequestFailedError,
    RequestNotFoundError,
    SessionNotFoundError,
    ShuttingDownError,
    SnapshotRefusedError,
    WorkerUnavailableError,
)


@dataclass(frozen=True, slots=True)
class ErrorMapping:
    grpc_code: grpc.StatusCode
    http_status: int
    expose_message: bool = True  # False: the client sees a generic message, the log has the detail


# Order matters only for subclasses: the first matching entry of the exception's MRO wins.
ERROR_TABLE: dict[type[BaseException], ErrorMapping] = {
    InvalidRequestError: ErrorMapping(grpc.StatusCode.INVALID_ARGUMENT, 400),
    QueueFullError: ErrorMapping(grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    DuplicateRequestError: ErrorMapping(grpc.StatusCode.ALREADY_EXISTS, 409),
    RequestNotFoundError: ErrorMapping(grpc.StatusCode.NOT_FOUND, 404),
    SessionNotFoundError: ErrorMapping(grpc.StatusCode.NOT_FOUND, 404),
    SnapshotRefusedError: ErrorMapping(grpc.StatusCode.FAILED_PRECONDITION, 409),
    WorkerUnavailableError: ErrorMapping(grpc.StatusCode.UNAVAILABLE, 503),
    ShuttingDownError: ErrorMapping(grpc.StatusCode.UNAVAILABLE, 503),
    NotInitializedError: ErrorMapping(grpc.StatusCode.UNAVAILABLE, 503),
    PlanError: ErrorMapping(grpc.StatusCode.FAILED_PRECONDITION, 400),
    RequestFailedError: ErrorMapping(grpc.StatusCode.INTERNAL, 500),
}
INTERNAL = ErrorMapping(grpc.StatusCode.INTERNAL, 500, expose_message=False)

# For the gateway: an upstream gRPC status -> the HTTP status the client gets.
GRPC_TO_HTTP: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def mapping_for(error: BaseException) -> ErrorMapping:
    for cls in type(error).__mro__:
        if cls in ERROR_TABLE:
            return ERROR_TABLE[cls]
    return INTERNAL


def grpc_status_for(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """(status code, details) to abort a call with."""
    mapping = mapping_for(error)
    return mapping.grpc_code, str(error) if mapping.expose_message else "internal error"


def http_status_for(error: BaseException) -> int:
    return mapping_for(error).http_status


def http_status_for_grpc(code: grpc.StatusCode) -> int:
    return GRPC_TO_HTTP.get(code, 500)
