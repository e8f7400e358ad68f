"""Every exception that crosses a service boundary on purpose.

Raised by the cores (scheduler, worker) and the servicers; translated to gRPC status codes and HTTP
statuses in one place, `error_table.py`. Pure classes: importing this module imports no grpc.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request whose fields are out of range; maps to INVALID_ARGUMENT / HTTP 400."""


class QueueFullError(Exception):
    """The scheduler's bounded waiting queue is full; maps to RESOURCE_EXHAUSTED / HTTP 429."""


class WorkerError(Exception):
    """Base class of every error the worker raises on purpose."""


class PlanError(WorkerError):
    """A step plan that cannot apply to the resident state (unknown id, bad block, over capacity).

    Raised by the runner's `validate` before any state changes, so the worker stays consistent and
    the scheduler can resync (maps to FAILED_PRECONDITION).
    """


class NotInitializedError(WorkerError):
    """`execute` called before `initialize` allocated the KV cache."""


class PagodaServiceError(Exception):
    """Base of the errors the service layer raises on purpose."""


class WorkerUnavailableError(PagodaServiceError):
    """No worker is connected (starting, lost and not back within --worker-timeout)."""


class RequestFailedError(PagodaServiceError):
    """The model fails on this request: it failed a step alone after failing one batched (the
    scheduler's poison isolation). Maps to INTERNAL / HTTP 500, with the worker's message."""


class DuplicateRequestError(PagodaServiceError):
    """A request id that is already running."""


class RequestNotFoundError(PagodaServiceError):
    """A request id that is not (or no longer) known."""


class SessionNotFoundError(PagodaServiceError):
    """Session save / restore: no lease to save, or no snapshot to restore (NOT_FOUND / HTTP 404)."""


class SnapshotRefusedError(PagodaServiceError):
    """A session snapshot that must not be served: a file corrupt (checksum) or another model's
    (fingerprint). Maps to FAILED_PRECONDITION / HTTP 409."""


class ShuttingDownError(PagodaServiceError):
    """The service is draining and accepts no new work."""
