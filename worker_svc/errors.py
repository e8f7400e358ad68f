"""The worker's domain errors; the service maps them to gRPC status codes in one table."""

from __future__ import annotations


class WorkerError(Exception):
    """Base class of every error the worker raises on purpose."""


class PlanError(WorkerError):
    """A step plan that cannot apply to the resident state (unknown id, bad block, over capacity).

    Raised by `ModelRunner.validate` before any state changes, so the worker stays consistent and
    the scheduler can resync (maps to FAILED_PRECONDITION).
    """


class NotInitializedError(WorkerError):
    """`execute` called before `initialize` allocated the KV cache."""
